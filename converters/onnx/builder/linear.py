"""Projections: GGUF weights wired as ``MatMulNBits`` (their blocks kept, see ``gguf_blocks``,
or re-rounded with searched scales, see ``quantize``) or, where blocks have no exact form, as
a float ``MatMul``."""

from __future__ import annotations

import numpy as np

from edgeinfer.gguf_file import TensorInfo

from ..quantize import quantize_searched
from .context import BuildContext
from .gguf_blocks import OFFSET_BLOCK, NBitsWeight, transcode
from .tensors import FLOAT_TYPES

__all__ = ["ACCURACY_LEVEL", "linear", "matmul_nbits", "requantize", "weights"]

ACCURACY_LEVEL = 4  # MatMulNBits quantizes activations to int8 per block: its fast CPU path


def requantize(w: np.ndarray, bits: int) -> NBitsWeight:
    """Float weights ``[n, k]`` re-rounded for ``--quant int4``/``int8``: symmetric blocks of
    32 (MatMulNBits' fast path) with error-minimising scales."""
    n, k = w.shape
    q = quantize_searched(w, bits)
    return NBitsWeight(n, k, q.bits, q.block_size, q.packed(), q.scales, offset=None)


def weights(b: BuildContext, t: TensorInfo) -> NBitsWeight | None:
    """The tensor as MatMulNBits blocks, or None where it is stored as floats."""
    if b.quant.mode == "fp32":
        return None
    bits = b.quant.bits_for(t.name)
    if bits is not None:
        return requantize(b.tensors.floats(t), int(bits))
    if t.ggml_type in FLOAT_TYPES:
        return None
    k, n = t.shape[0], t.shape[1]
    w = transcode(t.ggml_type, b.tensors.raw(t), n, k)
    if w is None:
        b.report.widened[t.name] = f"GGML type {t.ggml_type} has no exact MatMulNBits form"
    return w


def linear(b: BuildContext, x: str, ts: list[TensorInfo], stem: str) -> str:
    """x @ [W1; W2; ...].T for GGUF weights ([n rows of k]) that share the input x: one
    MatMulNBits over their rows together when their blocks have one form."""
    return _linear(b, x, [(t, weights(b, t)) for t in ts], stem)


def _linear(
    b: BuildContext, x: str, pairs: list[tuple[TensorInfo, NBitsWeight | None]], stem: str
) -> str:
    g = b.graph
    forms = {(w.bits, w.block_size) if w is not None else None for _, w in pairs}
    if len(forms) > 1 or None in forms:
        if len(pairs) > 1:  # one projection each, joined
            outs = [_linear(b, x, [p], f"{stem}.{i}") for i, p in enumerate(pairs)]
            return g.node("Concat", outs, axis=-1)[0]
        w = g.const(f"{stem}.weight_t", b.tensors.floats(pairs[0][0]).T.copy())
        return g.node("MatMul", [x, w])[0]
    parts = [w for _, w in pairs if w is not None]
    for w in parts:
        b.report.count_blocks(w.bits, w.block_size)
    packed = g.const(f"{stem}.qweight", np.concatenate([w.packed for w in parts]))
    scales = np.concatenate([w.scales.reshape(-1) for w in parts])
    n = sum(w.n for w in parts)
    y = matmul_nbits(b, x, packed, g.const(f"{stem}.scales", scales), parts[0], n)
    if all(w.offset is None for w in parts):
        return y
    return g.node("Add", [y, _offset_term(b, x, parts, stem)])[0]


def matmul_nbits(
    b: BuildContext, x: str, packed: str, scales: str, form: NBitsWeight, n: int
) -> str:
    """x @ W.T for ``n`` rows of blocks of ``form``'s width, size and K."""
    return b.graph.node(
        "MatMulNBits",
        [x, packed, scales],
        domain="com.microsoft",
        K=form.k,
        N=n,
        bits=form.bits,
        block_size=form.block_size,
        accuracy_level=ACCURACY_LEVEL,
    )[0]


def _offset_term(b: BuildContext, x: str, parts: list[NBitsWeight], stem: str) -> str:
    """blocksum32(x) @ offset.T: the per-block minimums of the types that have one, exact."""
    k = parts[0].k
    blocks = k // OFFSET_BLOCK
    offset = np.concatenate(
        [w.offset if w.offset is not None else np.zeros((w.n, blocks), np.float32) for w in parts]
    )
    sums = _block_sums(b, x, k)
    return b.graph.node("MatMul", [sums, b.graph.const(f"{stem}.offset_t", offset.T.copy())])[0]


def _block_sums(b: BuildContext, x: str, k: int) -> str:
    """x's sums over 32-wide blocks of its last axis: one MatMul with a 0/1 matrix [k, k / 32]
    (one node is cheaper per decode step than Reshape + ReduceSum), made once per x."""
    g = b.graph

    def summer() -> str:
        ones = np.zeros((k, k // OFFSET_BLOCK), np.float32)
        ones[np.arange(k), np.arange(k) // OFFSET_BLOCK] = 1.0
        return g.const(f"block_sum_{k}", ones)

    matrix = g.once(("block_sum", k), summer)
    return g.once(("sums", x), lambda: g.node("MatMul", [x, matrix])[0])
