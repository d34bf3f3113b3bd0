"""``edgeinfer batch --ray``: the same job on a local Ray started here (``ray.init(num_cpus=2)``),
with actors that each hold the tiny model. Its output must be byte for byte the local job's
(greedy, one slot per actor), and it resumes from a torn output the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.batch import run_batch

ray = pytest.importorskip("ray", reason="needs edgeinfer[ray]")
pytest.importorskip("ray.data", reason="needs edgeinfer[ray]")

from edgeinfer.batch.ray_job import run_ray_batch  # noqa: E402

OPTIONS = {"threads": 1}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[str]:
    context = ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield context.address_info["address"]
    ray.shutdown()


def job_file(path: Path) -> Path:
    rows: list[object] = [
        {"id": f"t{i}", "prompt": f"fox {i} dog", "max_tokens": 3 + i % 5} for i in range(23)
    ]
    rows[4] = {"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    rows[9] = "not json"
    rows[13] = {"id": "t2", "prompt": "a duplicate"}
    rows[17] = {"id": "long", "prompt": "fox " * 400}
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def local_output(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    folder = tmp_path_factory.mktemp("batch-local")
    out = folder / "out.jsonl"
    with edgeinfer.load(tiny_llama_gguf, **OPTIONS) as model:  # type: ignore[arg-type]
        run_batch(model, job_file(folder / "in.jsonl"), out, temperature=0, progress=False)
    return out.read_bytes()


@pytest.mark.parametrize("actors", [1, 2])
def test_ray_job_writes_what_the_local_job_writes(
    local_ray: str, tiny_llama_gguf: Path, local_output: bytes, tmp_path: Path, actors: int
) -> None:
    out = tmp_path / "out.jsonl"
    summary = run_ray_batch(
        tiny_llama_gguf,
        job_file(tmp_path / "in.jsonl"),
        out,
        actors=actors,
        load_options=OPTIONS,
        temperature=0,
        progress=False,
    )
    assert out.read_bytes() == local_output
    assert summary.written == 23 and summary.errors == 3


def test_ray_job_resumes_a_torn_output(
    local_ray: str, tiny_llama_gguf: Path, local_output: bytes, tmp_path: Path
) -> None:
    lines = local_output.splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(lines[:11]) + lines[11][:9])
    summary = run_ray_batch(
        tiny_llama_gguf,
        job_file(tmp_path / "in.jsonl"),
        out,
        load_options=OPTIONS,
        temperature=0,
        progress=False,
    )
    assert out.read_bytes() == local_output
    assert summary.skipped == 11 and summary.written == len(lines) - 11


def test_the_cli_runs_on_the_cluster_it_is_given(
    local_ray: str, tiny_llama_gguf: Path, local_output: bytes, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    src = job_file(tmp_path / "in.jsonl")
    args = [tiny_llama_gguf, src, "-o", out, "--temperature", "0", "--threads", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "batch", *map(str, args), f"--ray={local_ray}"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_bytes() == local_output
    assert "23 records written" in done.stderr
