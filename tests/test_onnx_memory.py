"""The ONNX route's memory: the plan against the measured peak in a fresh process (both
backends), and the prefill's logits held as one row, not the chunk's [chunk, vocab] block."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeinfer

LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")

CHILD = r"""
import json, sys
import edgeinfer
from edgeinfer.memory.rss import peak_rss
model, ctx = sys.argv[1], int(sys.argv[2])
with edgeinfer.load(model, context_length=ctx, threads=2) as llm:
    n_vocab = llm.info["vocab_size"]
    ids = [3 + (i * 7919) % (n_vocab - 3) for i in range(ctx - 24)]  # rows all over the table
    result = llm.generate(ids, max_new_tokens=16, temperature=0)
    plan = llm.info["memory_plan"]
    print(json.dumps({"peak": peak_rss(), "planned": plan["total"], "loaded": plan["loaded"],
                      "completion": result.stats.completion_tokens}))
"""


def _peak_and_plan(model: Path, ctx: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(ctx)],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _native_folder(gguf: Path, out: Path, max_context: int, kv_dtype: str = "float32") -> Path:
    pytest.importorskip("onnx")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    out.mkdir()
    write_gguf_folder(gguf, out, max_context=max_context, kv_dtype=kv_dtype)
    return out


@LINUX_ONLY
@pytest.mark.parametrize("ctx", [128, 256])  # the tiny model is trained to 256
def test_the_plan_covers_the_peak_of_a_tiny_model_on_both_backends(
    tiny_llama_gguf: Path, tmp_path: Path, ctx: int
) -> None:
    """A fresh process fills a fixed context and decodes: its peak resident set stays at or
    under the plan's total, on llama.cpp and on the native ONNX graph of the same file (with
    a float32 and a float16 KV cache)."""
    pytest.importorskip("llama_cpp")
    folder = _native_folder(tiny_llama_gguf, tmp_path / "native", ctx)
    half = _native_folder(tiny_llama_gguf, tmp_path / "kv16", ctx, "float16")
    for model in (tiny_llama_gguf, folder, half):
        out = _peak_and_plan(model, ctx)
        assert out["loaded"] is not None and out["completion"] > 0
        assert out["peak"] <= out["planned"], (model.name, out)


@pytest.mark.model
@LINUX_ONLY
@pytest.mark.parametrize("ctx", [2048, 8192])
def test_the_plan_covers_the_peak_of_the_default_model_on_both_backends(
    default_gguf: Path, tmp_path: Path, ctx: int
) -> None:
    folder = _native_folder(default_gguf, tmp_path / "native", ctx)
    half = _native_folder(default_gguf, tmp_path / "kv16", ctx, "float16")
    for model in (default_gguf, folder, half):
        out = _peak_and_plan(model, ctx)
        assert out["peak"] <= out["planned"], (model.name, out)


def test_a_prefill_chunk_leaves_one_row_of_logits(tiny_llama_onnx: Path) -> None:
    """A graph that returns every position's logits: each chunk's [chunk, vocab] block is
    released once its last row is copied, so the next chunk runs without it."""
    with edgeinfer.load(tiny_llama_onnx, context_length=256) as model:
        backend = model._backend
        assert not backend._last_only and not backend._shared  # the growing-cache kind
        backend._chunk = 8  # 40 tokens: five chunks
        ids = list(range(5, 45))
        logits = backend.prefill(ids)
        assert logits.ndim == 1
        assert logits.flags.owndata and logits.base is None  # no view into a chunk's block
        backend.rewind(0)
        backend._chunk = 256
        whole = backend.prefill(ids)  # one chunk: the same last row
        np.testing.assert_allclose(whole, logits, rtol=1e-4, atol=1e-4)
