"""A float16 KV cache in the native graph: half the cache's memory, in the plan and in the
buffers, with the logits of the float32 graph within half-precision rounding, on every tiny
family; asked for by ``load(kv_dtype=...)`` and ``convert --kv-dtype``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from edgeinfer.bench.workload import end_of_generation_ids
from edgeinfer.errors import EdgeInferError

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

_TINY_GGUFS = {"llama": "tiny_llama_gguf", "qwen2": "tiny_qwen2_gguf", "gemma3": "tiny_gemma_gguf"}
# 20 prompt tokens and 4 steps: past the tiny Gemma's 16-token sliding window
PROMPT = [1, 5, 9, 200, 17, 33, 4, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
STEPS = [7, 99, 3, 5]


def _folder(gguf: Path, out: Path, kv_dtype: str) -> Path:
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    out.mkdir()
    manifest, report = write_gguf_folder(gguf, out, max_context=128, kv_dtype=kv_dtype)
    assert manifest.architecture.kv_dtype == kv_dtype == report.kv_dtype
    return out


def _logits(folder: Path) -> tuple[list[np.ndarray], dict]:
    with edgeinfer.load(folder, context_length=128, threads=1) as model:
        backend = model._backend
        out = [np.array(backend.prefill(PROMPT), copy=True)]
        out += [np.array(backend.decode(t), copy=True) for t in STEPS]
        return out, model.info


@pytest.mark.parametrize("family", sorted(_TINY_GGUFS))
def test_a_float16_cache_answers_like_the_float32_one_in_half_the_memory(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    gguf = request.getfixturevalue(_TINY_GGUFS[family])
    want, info32 = _logits(_folder(gguf, tmp_path / "f32", "float32"))
    got, info16 = _logits(_folder(gguf, tmp_path / "f16", "float16"))
    for g, w in zip(got, want, strict=True):
        scale = float(np.abs(w).max())
        # halves keep ~3 significant digits: the logits move by rounding, not by a wrong graph
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * scale)
        assert w[int(np.argmax(g))] >= w.max() - 2e-2 * scale
    assert not all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    kv32 = info32["memory_plan"]["kv_cache"]
    kv16 = info16["memory_plan"]["kv_cache"]
    assert kv16 * 2 == kv32 > 0


def test_the_buffers_are_halves(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    folder = _folder(tiny_llama_gguf, tmp_path / "f16", "float16")
    with edgeinfer.load(folder, context_length=128, threads=1) as model:
        assert model.info["kv_dtype"] == "float16"
        backend = model._backend
        assert backend._kv_type == np.float16
        ban = {t: float("-inf") for t in end_of_generation_ids(model)}
        out = model.generate(PROMPT, max_new_tokens=4, temperature=0, logit_bias=ban)
        assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_an_unknown_kv_dtype_is_refused_before_anything_is_written(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    from edgeinfer.converters.onnx.builder import build_onnx_from_gguf

    with pytest.raises(EdgeInferError, match="float32 or float16"):
        build_onnx_from_gguf(tiny_llama_gguf, tmp_path, kv_dtype="int8")
    assert not any(tmp_path.iterdir())


def test_a_folder_runs_with_the_cache_its_graph_takes(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    from edgeinfer.errors import InvalidRequestError

    folder = _folder(tiny_llama_gguf, tmp_path / "f32", "float32")
    with pytest.raises(InvalidRequestError, match="convert SOURCE --to onnx --kv-dtype float16"):
        edgeinfer.load(folder, context_length=128, kv_dtype="float16")
    with edgeinfer.load(folder, context_length=128, kv_dtype="float32") as model:
        assert model.info["kv_dtype"] == "float32"
    with pytest.raises(InvalidRequestError, match="kv_dtype='int8' is invalid"):
        edgeinfer.load(folder, kv_dtype="int8")


def test_llama_cpp_takes_a_float32_cache_when_asked(tiny_llama_gguf: Path) -> None:
    pytest.importorskip("llama_cpp")
    runs = {}
    for kv in ("auto", "float32"):
        with edgeinfer.load(tiny_llama_gguf, context_length=128, threads=1, kv_dtype=kv) as m:
            backend = m._backend
            logits = np.array(backend.prefill(PROMPT), copy=True)
            runs[kv] = (m.info["kv_dtype"], m.info["memory_plan"]["kv_cache"], logits)
    (dtype16, kv16, logits16), (dtype32, kv32, logits32) = runs["auto"], runs["float32"]
    assert (dtype16, dtype32) == ("float16", "float32") and kv32 == 2 * kv16
    scale = float(np.abs(logits32).max())
    np.testing.assert_allclose(logits16, logits32, rtol=2e-2, atol=2e-2 * scale)


def test_convert_writes_a_float16_cache_and_validates_it(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "kv16"
    run = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "convert", str(tiny_llama_gguf), "-o", str(out),
         "--kv-dtype", "float16"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    manifest = json.loads((out / "edgeinfer.json").read_text())
    assert manifest["architecture"]["kv_dtype"] == "float16"
    assert manifest["validation"]["top1_agreement"] >= 0.9


def test_a_float16_cache_is_a_native_onnx_graph_only(tmp_path: Path) -> None:
    from edgeinfer.converters import ConvertConfig

    with pytest.raises(EdgeInferError, match="native ONNX builder"):
        ConvertConfig(tmp_path / "m.gguf", tmp_path / "out.gguf", kv_dtype="float16")
    with pytest.raises(EdgeInferError, match="use float32 or float16"):
        ConvertConfig(tmp_path / "m.gguf", tmp_path / "out", kv_dtype="bfloat16")


@pytest.mark.model
def test_the_default_model_transcode_with_a_float16_cache(default_gguf: Path) -> None:
    """The catalog name with kv_dtype="float16" builds its own transcode once (beside the
    exact one) and plans half the cache; its greedy reply stays in the float32 one's words
    for most of the way (the agreement figure is benchmarks' business)."""
    name = "smollm2-135m-instruct"
    replies, plans = {}, {}
    for kv in ("auto", "float16"):
        with edgeinfer.load(name, context_length=512, threads=1, kv_dtype=kv) as model:
            assert model.info["route"]["format"] == "onnx"
            assert model.info["kv_dtype"] == ("float32" if kv == "auto" else "float16")
            assert model.info["path"].endswith("-kv16") == (kv == "float16")
            plans[kv] = model.info["memory_plan"]["kv_per_slot"]
            ids = model.tokenize("The capital of France is")
            replies[kv] = model.generate(ids, max_new_tokens=8, temperature=0).token_ids
    assert plans["auto"] == 2 * plans["float16"]
    assert replies["float16"][:2] == replies["auto"][:2]
