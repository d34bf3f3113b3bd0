"""Projections: GGUF weights wired as ``MatMulNBits`` (their blocks kept, see ``gguf_blocks``,
or re-rounded with searched scales, see ``quantize``) or, where blocks have no exact form, as
a float ``MatMul``.

A projection's form is decided from the tensors' types before anything is read; its
initializers are then reserved in the data file and filled a band of rows at a time, so the
weights of a projection (or of q/k/v, gate/up joined) are never whole in memory."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.files.gguf_file import TensorInfo

from ..quantize import quantize_searched
from .context import BuildContext
from .gguf_blocks import FORMS, OFFSET_BLOCK, BlockForm, NBitsWeight, transcode
from .graph import Region
from .tensors import FLOAT_TYPES, float_bands, raw_bands

__all__ = [
    "ACCURACY_LEVEL",
    "block_form",
    "block_sums",
    "linear",
    "matmul_nbits",
    "requantize",
    "weight_bands",
    "write_blocks",
]

ACCURACY_LEVEL = 4  # MatMulNBits quantizes activations to int8 per block: its fast CPU path
REQUANT_BLOCK = 32  # --quant int4/int8: symmetric blocks of 32, MatMulNBits' fast path


def requantize(w: np.ndarray, bits: int) -> NBitsWeight:
    """Float weights ``[n, k]`` re-rounded for ``--quant int4``/``int8``: symmetric blocks of
    32 (MatMulNBits' fast path) with error-minimising scales."""
    n, k = w.shape
    q = quantize_searched(w, bits, REQUANT_BLOCK)
    return NBitsWeight(n, k, q.bits, q.block_size, q.packed(), q.scales, offset=None)


def block_form(b: BuildContext, t: TensorInfo) -> BlockForm | None:
    """The form ``t`` takes as MatMulNBits blocks, or None where it is stored as floats."""
    if b.quant.mode == "fp32":
        return None
    bits = b.quant.bits_for(t.name)
    if bits is not None:
        return BlockForm(int(bits), REQUANT_BLOCK)
    if t.ggml_type in FLOAT_TYPES:
        return None
    return FORMS.get(t.ggml_type)


def weight_bands(b: BuildContext, t: TensorInfo) -> Iterator[NBitsWeight]:
    """``t``'s blocks in ``block_form(b, t)``, a band of rows at a time."""
    k, n = t.shape
    bits = b.quant.bits_for(t.name)
    if bits is not None:
        for _, rows in float_bands(b.tensors, t):
            yield requantize(rows, int(bits))
        return
    row_bytes = (t.nbytes or 0) // n
    for _, raw in raw_bands(b.tensors, t):
        w = transcode(t.ggml_type, raw, raw.size // row_bytes, k)
        if w is None:
            raise ConversionError(f"tensor {t.name}: GGML type {t.ggml_type} has no blocks")
        yield w


def linear(b: BuildContext, x: str, ts: list[TensorInfo], stem: str) -> str:
    """x @ [W1; W2; ...].T for GGUF weights ([n rows of k]) that share the input x: one
    MatMulNBits over their rows together when their blocks have one kernel."""
    forms = [block_form(b, t) for t in ts]
    kernels = {f.kernel if f is not None else None for f in forms}
    if len(kernels) > 1 or None in kernels:
        if len(ts) > 1:  # one projection each, joined
            outs = [linear(b, x, [t], f"{stem}.{i}") for i, t in enumerate(ts)]
            return b.graph.node("Concat", outs, axis=-1)[0]
        return _float_matmul(b, x, ts[0], stem)
    present = [f for f in forms if f is not None]
    form = BlockForm(*present[0].kernel, offset=any(f.offset for f in present))
    return _blocks_matmul(b, x, ts, form, stem)


def _float_matmul(b: BuildContext, x: str, t: TensorInfo, stem: str) -> str:
    if b.quant.mode != "fp32" and t.ggml_type not in FLOAT_TYPES:
        b.report.widened[t.name] = f"GGML type {t.ggml_type} has no exact MatMulNBits form"
    k, n = t.shape
    weight_t = b.graph.reserve(f"{stem}.weight_t", (k, n), np.float32)
    for start, rows in float_bands(b.tensors, t):
        weight_t.write_columns(start, rows)
    weight_t.done()
    return b.graph.node("MatMul", [x, weight_t.name])[0]


def _blocks_matmul(
    b: BuildContext, x: str, ts: list[TensorInfo], form: BlockForm, stem: str
) -> str:
    g, k = b.graph, ts[0].shape[0]
    n = sum(t.shape[1] for t in ts)
    for _ in ts:
        b.report.count_blocks(form.bits, form.block_size)
    blocks = k // form.block_size
    packed = g.reserve(f"{stem}.qweight", (n, blocks, form.block_size * form.bits // 8), np.uint8)
    scales = g.reserve(f"{stem}.scales", (n * blocks,), np.float32)
    y = matmul_nbits(b, x, packed.name, scales.name, form, k, n)
    offset = None
    if form.offset:  # + blocksum32(x) @ offset.T: the per-block minimums, exact
        sums = block_sums(b, x, k)
        offset = g.reserve(f"{stem}.offset_t", (k // OFFSET_BLOCK, n), np.float32)
        y = g.node("Add", [y, g.node("MatMul", [sums, offset.name])[0]])[0]
    row = 0
    for t in ts:
        for w in weight_bands(b, t):
            write_blocks(w, row, packed, scales, offset)
            row += w.n
    for region in (packed, scales, offset):
        if region is not None:
            region.done()
    return y


def write_blocks(
    w: NBitsWeight, row: int, packed: Region, scales: Region, offset_t: Region | None
) -> None:
    """Rows ``row .. row + w.n`` of a projection: its packed blocks and scales, and the
    columns of its transposed offsets (zeros for a type without them)."""
    packed.write(row * w.packed[0].size, w.packed)
    scales.write(row * w.scales.shape[1], w.scales)
    if offset_t is not None:
        values = w.offset
        if values is None:
            values = np.zeros((w.n, w.k // OFFSET_BLOCK), np.float32)
        offset_t.write_columns(row, values)


def matmul_nbits(
    b: BuildContext, x: str, packed: str, scales: str, form: BlockForm, k: int, n: int
) -> str:
    """x @ W.T for ``n`` rows of ``k`` in blocks of ``form``'s width and size."""
    return b.graph.node(
        "MatMulNBits",
        [x, packed, scales],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=form.bits,
        block_size=form.block_size,
        accuracy_level=ACCURACY_LEVEL,
    )[0]


def block_sums(b: BuildContext, x: str, k: int) -> str:
    """x's sums over 32-wide blocks of its last axis: one MatMul with a 0/1 matrix [k, k / 32]
    (one node is cheaper per decode step than Reshape + ReduceSum), made once per x."""
    g = b.graph

    def summer() -> str:
        ones = np.zeros((k, k // OFFSET_BLOCK), np.float32)
        ones[np.arange(k), np.arange(k) // OFFSET_BLOCK] = 1.0
        return g.const(f"block_sum_{k}", ones)

    matrix = g.once(("block_sum", k), summer)
    return g.once(("sums", x), lambda: g.node("MatMul", [x, matrix])[0])
