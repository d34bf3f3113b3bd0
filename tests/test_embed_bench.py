"""``edgeinfer bench`` on embedding models: a real process over a tiny random BERT folder and
its GGUF, rows with texts/s and the cosine to the reference row; bad flags end with one line.
No timing is asserted (the machine is shared): only that figures exist and agree in kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.bench.embed import is_embedding_model, tickets
from edgeinfer.files.encoder_folder import read_encoder_folder

from .bertgen import make_bert_folder

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    from edgeinfer.converters.gguf.bert import write_bert_gguf

    tmp = tmp_path_factory.mktemp("embed-bench")
    folder = make_bert_folder(tmp / "bert")
    gguf = write_bert_gguf(read_encoder_folder(folder), tmp / "bert.gguf")
    env = {**os.environ, "EDGEINFER_HOME": str(tmp / "home")}
    return folder, gguf, env


def bench(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer", "bench", *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


def test_bench_measures_both_routes_with_the_cosine_to_the_reference(
    models: tuple[Path, Path, dict[str, str]],
) -> None:
    folder, gguf, env = models
    run = bench(env, str(folder), str(gguf), "--json", "-r", "1", "--warmup", "0",
                "--threads", "1")  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert [r["model"] for r in report["rows"]] == [str(folder), str(gguf)]
    assert report["reference"] == f"edgeinfer/{folder}"
    for row in report["rows"]:
        assert row["texts_per_s_median"] > 0 and row["min_cosine_to_reference"] >= 0.999
    assert report["workload"] == {"texts": len(tickets()), "batch": 32, "threads": 1}
    table = bench(env, str(gguf), "-r", "1", "--warmup", "0", "--threads", "1")
    assert table.returncode == 0 and "texts/s" in table.stdout and str(gguf) in table.stdout


def test_embedding_models_are_told_from_generative_ones(
    models: tuple[Path, Path, dict[str, str]], tiny_llama_gguf: Path
) -> None:
    folder, gguf, _ = models
    assert is_embedding_model(str(folder)) and is_embedding_model(str(gguf))
    assert is_embedding_model("all-minilm-l6-v2")
    assert not is_embedding_model(str(tiny_llama_gguf))
    assert not is_embedding_model("smollm2-135m-instruct")
    assert not is_embedding_model("no/such/model")


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.text(max_size=12), st.sampled_from(["0", "1,2", "-1", "9999", "2 "])))
def test_bad_threads_end_with_one_clear_line(
    models: tuple[Path, Path, dict[str, str]], threads: str
) -> None:
    from edgeinfer.bench.embed import cmd_bench_embed
    from edgeinfer.errors import InvalidRequestError

    args = type("Args", (), {"threads": threads, "models": [str(models[1])]})()
    if threads.isdigit() and 1 <= int(threads) <= 256:
        return  # a valid count: measured by the test above
    with pytest.raises(InvalidRequestError, match="--threads"):
        cmd_bench_embed(args)  # type: ignore[arg-type]


def test_a_bad_thread_count_ends_the_real_process_with_one_line(
    models: tuple[Path, Path, dict[str, str]],
) -> None:
    run = bench(models[2], str(models[1]), "--threads", "two")
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode > 0 and len(lines) == 1 and "--threads" in lines[0], run.stderr
