"""Symmetric n-bit blocks with error-minimising scales, for re-rounding float weights.

Plain round-to-nearest maps each block's value of largest magnitude to the most negative
integer and rounds the rest against that scale. That pins the scale to one value: the block's
other 31 values get whatever rounding error it leaves them. Here each block tries a set of
candidate scales around it (the extreme mapped to ``-half ± a fraction``, and to the most
positive integer, which the asymmetric range ``[-half, half - 1]`` makes a different grid);
for each candidate the integers are rounded, and the scale is then refitted to them by least
squares (``d = Σ w x q / Σ w q²``). The candidate whose refit leaves the smallest weighted
squared error ``Σ w (x - d q)²`` wins. Round-to-nearest is one of the candidates and the refit
never raises a candidate's error, so every block's error is at most round-to-nearest's.

The blocks come out as ``Blocks``: unsigned ``u = q + half`` under MatMulNBits' default zero
point, so the graph runs on its fast path (no zero-point input). Plain numpy: the builder
imports this, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.errors import ConversionError

__all__ = ["Blocks", "block_errors", "quantize_rtn", "quantize_searched"]

# candidate magnitudes the extreme maps to, in units of one integer step: on the negative
# side around -half, on the positive side up to half - 1 (round(x) may not pass it)
_NEGATIVE = np.linspace(-1.0, 1.0, 11)  # -(half + t)
_POSITIVE = np.linspace(-1.5, 0.45, 7)  # +(half - 1 + t)
_CHUNK = 2048  # blocks per pass: the working arrays stay in cache


@dataclass(frozen=True)
class Blocks:
    """Symmetric blocks along K of an ``[n, k]`` weight: ``x = scale * (u - half)``."""

    bits: int
    block_size: int
    u: np.ndarray  # uint8 [n, k]
    scales: np.ndarray  # float32 [n, k // block_size]

    def packed(self) -> np.ndarray:
        """``u`` as MatMulNBits reads it, uint8 ``[n, blocks, block_size * bits // 8]``:
        8-bit as is, 4-bit two per byte with element 2i in the low nibble."""
        n, k = self.u.shape
        rows = self.u.reshape(n, k // self.block_size, self.block_size)
        if self.bits == 8:
            return np.ascontiguousarray(rows)
        pairs = rows.reshape(n, k // self.block_size, self.block_size // 2, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4), np.uint8)

    def dequantize(self) -> np.ndarray:
        n, k = self.u.shape
        half = float(1 << (self.bits - 1))
        signed = self.u.astype(np.float32).reshape(n, -1, self.block_size) - half
        return (self.scales[..., None] * signed).reshape(n, k)


def quantize_searched(
    w: np.ndarray, bits: int, block_size: int = 32, importance: np.ndarray | None = None
) -> Blocks:
    """Float weights ``[n, k]`` as symmetric ``bits``-bit blocks of ``block_size`` along K,
    each block's scale chosen by the search described above. ``importance`` (``[k]`` or
    ``[n, k]``, non-negative) weighs each element's squared error; None weighs them equally."""
    n, k = _checked(w, block_size)
    blocks = np.ascontiguousarray(w, np.float32).reshape(-1, block_size)
    weights = None
    if importance is not None:
        weights = np.broadcast_to(np.asarray(importance, np.float32), (n, k)).reshape(
            -1, block_size
        )
    q = np.empty(blocks.shape, np.int8)
    scales = np.empty(len(blocks), np.float32)
    for start in range(0, len(blocks), _CHUNK):
        part = slice(start, start + _CHUNK)
        chunk_w = None if weights is None else weights[part].astype(np.float64)
        q[part], scales[part] = _search(blocks[part].astype(np.float64), bits, chunk_w)
    return _blocks(q, scales, n, k, bits, block_size)


def quantize_rtn(w: np.ndarray, bits: int, block_size: int = 32) -> Blocks:
    """Round-to-nearest: the extreme maps to ``-half``, the rest round against it (the
    baseline the search is measured against)."""
    n, k = _checked(w, block_size)
    blocks = np.ascontiguousarray(w, np.float32).reshape(-1, block_size)
    half = 1 << (bits - 1)
    extreme = _extreme(blocks)
    scales = extreme / -half
    inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales != 0)
    q = np.clip(np.rint(blocks * inverse[:, None]), -half, half - 1)
    return _blocks(q, scales, n, k, bits, block_size)


def block_errors(w: np.ndarray, q: Blocks, importance: np.ndarray | None = None) -> np.ndarray:
    """Each block's weighted squared error ``Σ w (x - x̂)²`` of ``q`` against ``w``, in
    float64 (float32 would blur near-ties between candidates)."""
    n, k = q.u.shape
    signed = q.u.astype(np.float64).reshape(n, -1, q.block_size) - (1 << (q.bits - 1))
    approx = (q.scales.astype(np.float64)[..., None] * signed).reshape(n, k)
    diff = (np.asarray(w, np.float64) - approx) ** 2
    if importance is not None:
        diff = diff * np.asarray(importance, np.float64)
    return diff.reshape(-1, q.block_size).sum(axis=1)


def _blocks(
    q: np.ndarray, scales: np.ndarray, n: int, k: int, bits: int, block_size: int
) -> Blocks:
    if bits not in (4, 8):
        raise ConversionError(f"{bits}-bit blocks: MatMulNBits' fast path takes 4 or 8")
    u = (q.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8).reshape(n, k)
    return Blocks(bits, block_size, u, scales.astype(np.float32).reshape(n, k // block_size))


def _checked(w: np.ndarray, block_size: int) -> tuple[int, int]:
    if w.ndim != 2:
        raise ConversionError(f"weights must be [n, k] to quantize, not {w.shape}")
    n, k = w.shape
    if block_size <= 0 or k % block_size:
        raise ConversionError(
            f"a row of {k} weights is not whole blocks of {block_size}: quantize it with "
            "--quant int8 or keep it as floats (--quant fp32)"
        )
    if not np.isfinite(w).all():
        raise ConversionError(
            "the weights hold NaN or infinity: the source is damaged; convert a sound copy"
        )
    return n, k


def _extreme(blocks: np.ndarray) -> np.ndarray:
    """Each block's value of largest magnitude, with its sign."""
    at = np.abs(blocks).argmax(axis=1)[:, None]
    return np.take_along_axis(blocks, at, axis=1)[:, 0]


def _search(x: np.ndarray, bits: int, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The best (integers, scale) per block of ``x`` [m, block] over the candidates, in
    float64: at 8 bits the candidates' errors differ by less than float32 resolves."""
    half = 1 << (bits - 1)
    extreme = _extreme(x)
    inverse = 1.0 / np.where(extreme == 0, 1.0, extreme)
    wx = x if weights is None else weights * x
    best_gain = np.full(len(x), -1.0)
    best_d = np.zeros(len(x))
    best_q = np.zeros_like(x)
    q = np.empty_like(x)
    qq = np.empty_like(x)
    for target in _targets(half):
        _round(x, inverse * target, half, q)
        np.multiply(q, q, out=qq)
        if weights is not None:
            qq *= weights
        sum_xq = np.einsum("ij,ij->i", wx, q)
        sum_qq = qq.sum(axis=1)
        # error = Σ w x² - (Σ w x q)² / Σ w q²: the largest gain is the smallest error
        d = np.divide(sum_xq, sum_qq, out=np.zeros_like(sum_xq), where=sum_qq > 0)
        gain = d * sum_xq
        better = gain > best_gain
        best_gain[better] = gain[better]
        best_d[better] = d[better]
        np.copyto(best_q, q, where=better[:, None])
    return best_q.astype(np.int8), best_d


def _targets(half: int) -> list[float]:
    return [-(half + t) for t in _NEGATIVE] + [half - 1 + t for t in _POSITIVE]


def _round(x: np.ndarray, factor: np.ndarray, half: int, out: np.ndarray) -> None:
    """``out = clip(rint(x * factor), -half, half - 1)`` per block, in place."""
    np.multiply(x, factor[:, None], out=out)
    np.rint(out, out=out)
    np.clip(out, -half, half - 1, out=out)
