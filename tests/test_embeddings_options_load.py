"""load() and the CLI refuse what an embedding model would ignore (issue 34, item 6): parallel,
prompt_cache, kv_dtype, context_length, context_overflow, flash_attention, another engine,
for an encoder folder (ONNX) and an encoder GGUF (llama.cpp) alike."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import edgeinfer
from edgeinfer.errors import InvalidRequestError
from edgeinfer.files.encoder_folder import read_encoder_folder

from .bertgen import make_bert_folder

pytest.importorskip("onnxruntime")
pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")


@pytest.fixture(scope="module", params=["encoder", "gguf"])
def bert(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_bert_folder(tmp_path_factory.mktemp("bert-options") / "bert")
    if request.param == "encoder":
        return folder
    from edgeinfer.converters.gguf.bert import write_bert_gguf

    return write_bert_gguf(read_encoder_folder(folder), folder.parent / "bert.gguf")


@pytest.fixture(autouse=True)
def _home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path_factory.getbasetemp() / "home"))


ASKED: list[tuple[str, Any]] = [
    ("parallel", 4), ("parallel", "auto"), ("prompt_cache", "CACHE"), ("prompt_cache", True),
    ("kv_dtype", "float16"), ("context_length", 64), ("context_overflow", "slide"),
    ("flash_attention", True),
]  # fmt: skip


@pytest.mark.parametrize(("key", "value"), ASKED)
def test_load_refuses_what_an_embedding_model_ignores(
    bert: Path, tmp_path: Path, key: str, value: Any
) -> None:
    value = str(tmp_path / "cache") if value == "CACHE" else value
    with pytest.raises(InvalidRequestError, match=f"^{key}=.*is an embedding model") as caught:
        edgeinfer.load(bert, threads=1, **{key: value})
    assert "device, memory_budget, threads and allow_fallback" in str(caught.value)


def test_another_engine_is_refused_and_its_own_is_taken(bert: Path) -> None:
    ours, other = (
        ("llama.cpp", "onnxruntime") if bert.suffix == ".gguf" else ("onnxruntime", "llama.cpp")
    )
    with pytest.raises(InvalidRequestError, match=f"run by {ours} only"):
        edgeinfer.load(bert, threads=1, engine=other)
    with edgeinfer.load(bert, threads=1, engine=ours, parallel=1, prompt_cache=None) as model:
        assert model.embed("hello").shape[0] == 1


@pytest.mark.parametrize("flags", [["--context-length", "64"], ["--kv-dtype", "float16"],
                                   ["--context-overflow", "slide"]])  # fmt: skip
def test_the_cli_refuses_it_in_one_line(bert: Path, tmp_path: Path, flags: list[str]) -> None:
    env = {**os.environ, "EDGEINFER_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "embed", str(bert), "--threads", "1", *flags],
        input="hello\n", capture_output=True, text=True, timeout=300, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode not in (0, -signal.SIGSEGV) and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"edgeinfer: error: {flags[0][2:].replace('-', '_')}=")
