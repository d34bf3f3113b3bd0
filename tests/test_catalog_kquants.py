"""Catalog GGUFs of K-quant mixes (the two Qwen2.5-Coder entries are Q4_K_M: Q4_K and Q6_K
blocks, with Q5_0 and Q8_0 where a row is not a whole number of 256-wide blocks) on the route
rule. The native builder keeps every one of those types as blocks (``gguf_blocks.TRANSCODABLE``),
but its exact forms of them are larger than the blocks (a step reads 1.4x the file), so on a CPU
the rule runs few sequences of such a file on llama.cpp and many on the exact ONNX transcode.

A tiny random Llama quantized by llama.cpp to Q4_K_M (hidden 256, an MLP of 288 so that
``ffn_down`` falls back to Q5_0/Q8_0) stands in for them: no download. Its weights are small
(std 0.025): with the generator's std 0.5, two layers turn any rounding into other answers
(llama.cpp on the Q4_K_M file against llama.cpp on its own weights dequantized: cosine 0.91).

"Exact" is about the weights: both engines round the activations to 8 bits in their quantized
products (llama.cpp's Q8_K/Q8_0 dot products, MatMulNBits' accuracy level 4), so the
transcode's logits are measured against llama.cpp on the file's weights dequantized to f32 by
the ``gguf`` package (float products, no activation rounding), beside llama.cpp's own distance
from there on the quantized file."""

from __future__ import annotations

import hashlib
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from edgeinfer.files import catalog
from edgeinfer.files.catalog import CatalogEntry
from edgeinfer.files.gguf_file import read_gguf_header
from edgeinfer.loader import resolve, route_for

from .ggufgen import Model, Tensor, tiny_llama

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

Q4_K, Q5_0, Q6_K, Q8_0 = 12, 6, 14, 8
NAME = "tiny-kquants"
TEXT = "def add(a, b): return a + b  # the sum of two numbers"


def small_tiny_llama() -> Model:
    model = tiny_llama(hidden=256, ffn=288, heads=4, kv_heads=2, layers=2, seed=5)
    model.tensors = [
        t if t.name.endswith("norm.weight") else _scaled(t, 0.05) for t in model.tensors
    ]
    return model


def _scaled(t: Tensor, factor: float) -> Tensor:
    values = np.frombuffer(t.data, np.float32) * np.float32(factor)
    return Tensor(t.name, t.shape, values.astype(np.float32).tobytes())


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edgeinfer.converters.gguf.writer import quantize_gguf

    folder = tmp_path_factory.mktemp("kquants")
    src = small_tiny_llama().write(folder / "f32.gguf")
    out = folder / "tiny-q4_k_m.gguf"
    quantize_gguf(src, out, "q4_k_m", threads=1)
    return out


@pytest.fixture(scope="module")
def dequantized_gguf(kquant_gguf: Path) -> Path:
    """The Q4_K_M file's weights dequantized by the gguf package, as an f32 GGUF."""
    header = read_gguf_header(kquant_gguf)
    raw = kquant_gguf.read_bytes()
    model = small_tiny_llama()
    stored = {t.name: t for t in header.tensors}
    tensors = []
    for t in model.tensors:
        info = stored[t.name]
        start = header.data_offset + info.offset
        blocks = np.frombuffer(raw[start : start + info.nbytes], np.uint8)
        values = gguf.quants.dequantize(blocks, info.ggml_type).astype(np.float32)
        tensors.append(Tensor(t.name, t.shape, values.tobytes()))
    model.tensors = tensors
    return model.write(kquant_gguf.with_name("dequantized-f32.gguf"))


@pytest.fixture
def catalog_kquants(
    kquant_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> CatalogEntry:
    """The tiny Q4_K_M file as a present catalog entry of a fresh $EDGEINFER_HOME."""
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    data = kquant_gguf.read_bytes()
    entry = CatalogEntry(
        name=NAME,
        format="gguf",
        package="tiny-kquants-part{n}",
        version="1.0",
        member="tiny_kquants_part{n}/data/part{n:02d}.bin",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        description="test entry",
        parts=2,
        local_name=kquant_gguf.name,
    )
    monkeypatch.setitem(catalog.CATALOG, NAME, entry)
    target = catalog.local_path(entry)
    target.parent.mkdir(parents=True)
    shutil.copyfile(kquant_gguf, target)
    return entry


def test_the_stand_in_has_the_qwen_entries_block_types(kquant_gguf: Path) -> None:
    from edgeinfer.converters.onnx.builder.gguf_blocks import TRANSCODABLE

    header = read_gguf_header(kquant_gguf)
    types = Counter(t.ggml_type for t in header.tensors if len(t.shape) == 2)
    assert header.metadata["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert {Q4_K, Q5_0, Q6_K, Q8_0} <= set(types) <= TRANSCODABLE


def test_a_kquant_catalog_gguf_runs_few_sequences_on_llama_cpp_and_many_on_the_transcode(
    catalog_kquants: CatalogEntry,
) -> None:
    source = resolve(NAME)
    one = route_for(NAME, source, "cpu")
    assert one.format == "gguf" and "the file's bytes a step" in one.why
    many = route_for(NAME, source, "cpu", parallel=8)
    assert (many.format, many.source) == ("onnx", "gguf")
    assert "exact ONNX transcode of the same blocks" in many.why
    assert route_for(NAME, source, "cpu", engine="onnxruntime").format == "onnx"
    assert route_for(NAME, source, "cpu", parallel=8, engine="llama.cpp").format == "gguf"


def test_its_transcode_has_the_files_weights(
    catalog_kquants: CatalogEntry, kquant_gguf: Path, dequantized_gguf: Path
) -> None:
    """The transcode ``load()`` builds for the catalog name answers as the file's own weights
    do (llama.cpp on them dequantized), no further from them than llama.cpp on the quantized
    file is (measured: 0.014 against llama.cpp's 0.022 at most, a logit scale of ~1), and as
    llama.cpp on the file within both engines' activation rounding."""
    ids, truth = _llama_cpp_logits(dequantized_gguf, TEXT)
    ids_q, llama_q = _llama_cpp_logits(kquant_gguf, TEXT)
    assert ids == ids_q
    with edgeinfer.load(NAME, device="cpu", context_length=128, threads=1,
                        engine="onnxruntime") as model:  # fmt: skip
        route = model.info["route"]
        assert route["format"] == "onnx" and "exact ONNX transcode" in route["why"], route
        assert model.tokenize(TEXT) == ids
        ours = []
        for n in range(1, len(ids) + 1):
            model._backend.rewind(0)
            ours.append(np.asarray(model._backend.prefill(ids[:n]), dtype=np.float64))
    got = np.stack(ours)
    ours_off, theirs_off = np.abs(got - truth).max(), np.abs(llama_q - truth).max()
    assert ours_off <= 1.5 * theirs_off + 1e-4, (ours_off, theirs_off)
    assert _cosine(got, truth) >= 0.9995 and _cosine(got, llama_q) >= 0.9995


def test_the_builder_report_for_the_kquant_file(kquant_gguf: Path, tmp_path: Path) -> None:
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    folder = tmp_path / "onnx"
    folder.mkdir()
    _, report = write_gguf_folder(kquant_gguf, folder, max_context=128)
    assert report.widened == {}
    # Q4_K as 4-bit/32 blocks (with the offset term), Q6_K as 8-bit/16, Q5_0 and Q8_0 8-bit/32
    assert {"4-bit/32", "8-bit/16", "8-bit/32"} <= set(report.nbits), report.nbits


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The lowest per-position cosine of two [positions, vocab] logit arrays."""
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return float(cos.min())


def _llama_cpp_logits(gguf: Path, text: str) -> tuple[list[int], np.ndarray]:
    """(ids, every position's logits) from llama.cpp with a float32 KV cache."""
    from edgeinfer.bench.peers import policy_llama

    f32_cache = 0  # GGML_TYPE_F32
    ref = policy_llama(
        str(gguf), n_ctx=128, logits_all=True, type_k=f32_cache, type_v=f32_cache, verbose=False
    )
    try:
        ids = list(ref.tokenize(text.encode(), add_bos=True))
        ref.eval(ids)
        return ids, np.array(ref.scores[: len(ids)], dtype=np.float64)
    finally:
        ref.close()
