"""The native builder streams: every weight is read, transcoded and written a band of rows at a
time (``tensors.BAND_ELEMENTS``), so a conversion's working set is a band, not the model and
not even its largest tensor. The property is measured with ``tracemalloc`` (numpy reports its
buffers to it) on a tiny K-quant mix whose tensors are far larger than a band, so it holds on
any machine; ``benchmarks/transcode_memory.py`` measures the peak RSS of real conversions."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

import pytest

from edgeinfer.converters.onnx.builder import build_onnx_from_gguf, tensors
from edgeinfer.files.gguf_file import read_gguf_header

from .ggufgen import Tensor, tiny_llama

gguf = pytest.importorskip("gguf")
pytest.importorskip("onnx")

Q4_K, Q5_0, Q6_K, Q8_0 = 12, 6, 14, 8


def _q4_k_m_mix(t: Tensor) -> int:
    """llama.cpp's Q4_K_M choices on a Qwen-like file: Q6_K down projections and head, Q8_0
    values, Q5_0 where rows are not whole 256-blocks (the embedding here), Q4_K the rest."""
    if t.name == "token_embd.weight":
        return Q5_0
    if "ffn_down" in t.name or t.name == "output.weight":
        return Q6_K
    return Q8_0 if "attn_v" in t.name else Q4_K


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Llama of random Q4_K_M-style blocks: its MLP tensors are 1.2-1.7 MB each,
    hundreds of times a band of the size the tests set."""
    from .test_gguf_blocks import random_tensor

    model = tiny_llama(hidden=512, ffn=4096, heads=8, kv_heads=2, layers=1)
    vocab = model.tensors[0].shape[1]
    model.tensors.append(Tensor("output.weight", (512, vocab), b""))
    blocks = []
    for i, t in enumerate(model.tensors):
        if len(t.shape) != 2:
            blocks.append(t)
            continue
        qtype = _q4_k_m_mix(t)
        raw = random_tensor(qtype, t.shape[1], t.shape[0], seed=i)
        blocks.append(Tensor(t.name, t.shape, raw.tobytes(), qtype))
    model.tensors = blocks
    return model.write(tmp_path_factory.mktemp("kquant-mix") / "mix.gguf")


def _build(src: Path, out: Path) -> tuple[int, str]:
    """(the build's peak traced bytes, a digest of the files it wrote)."""
    out.mkdir()
    tracemalloc.start()
    try:
        build_onnx_from_gguf(src, out, max_context=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    digest = hashlib.sha256()
    for name in ("model.onnx", "model.onnx.data"):
        digest.update((out / name).read_bytes())
    return peak, digest.hexdigest()


def test_the_build_holds_a_band_not_a_tensor(
    kquant_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With bands of 8,192 weights, the whole build's peak of traced memory is under half the
    largest tensor's GGUF bytes: no tensor is ever whole in memory, in any form."""
    build_onnx_from_gguf(kquant_gguf, _fresh(tmp_path / "warm"), max_context=64)  # imports
    monkeypatch.setattr(tensors, "BAND_ELEMENTS", 8192)
    largest = max(t.nbytes or 0 for t in read_gguf_header(kquant_gguf).tensors)
    peak, _ = _build(kquant_gguf, tmp_path / "banded")
    assert largest > 1_500_000
    assert peak < largest // 2, (peak, largest)


def test_bands_do_not_change_a_byte(
    kquant_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row at a time or whole tensors at a time, the files are the same."""
    monkeypatch.setattr(tensors, "BAND_ELEMENTS", 1 << 30)
    _, whole = _build(kquant_gguf, tmp_path / "whole")
    monkeypatch.setattr(tensors, "BAND_ELEMENTS", 1)
    _, rows = _build(kquant_gguf, tmp_path / "rows")
    assert rows == whole


def _fresh(folder: Path) -> Path:
    folder.mkdir()
    return folder
