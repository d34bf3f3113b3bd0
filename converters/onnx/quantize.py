"""Symmetric n-bit blocks with error-minimising scales, for re-rounding float weights.

Plain round-to-nearest maps each block's value of largest magnitude to the most negative
integer and rounds the rest against that scale. That pins the scale to one value: the block's
other 31 values get whatever rounding error it leaves them. Here each block tries a set of
candidate scales around it (the extreme mapped to ``-half ± a fraction``, and to the most
positive integer, which the asymmetric range ``[-half, half - 1]`` makes a different grid);
for each candidate the integers are rounded, and the scale is then refitted to them by least
squares (``d = Σ w x q / Σ w q²``). The candidate whose refit leaves the smallest weighted
squared error ``Σ w (x - d q)²`` wins.

The winner's scale is then stored in float32, which moves it: by one part in 10⁷ for a normal
scale, by far more for a subnormal one (a block near float32's smallest normal value has a
scale 8 to 128 times smaller, where float32 keeps fewer bits). So the integers are rounded
again against the stored scale (the best integers for it), a scale stored as subnormal or zero
also tries its float32 neighbours, and each block's error with its stored scale is compared, in
float64, with round-to-nearest's: round-to-nearest is kept wherever the search is not strictly
better. Every block's error is therefore at most round-to-nearest's, whatever its magnitude.
A scale whose integers would dequantize past float32's largest value (a block near it) counts
as infinitely bad: round-to-nearest's never does, its extreme maps back onto itself.

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
_FLOAT32_MAX = float(np.finfo(np.float32).max)


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
    weights = None if importance is None else _checked_importance(importance, n, k, block_size)
    q = np.empty(blocks.shape, np.int8)
    scales = np.empty(len(blocks), np.float32)
    for start in range(0, len(blocks), _CHUNK):
        part = slice(start, start + _CHUNK)
        x = blocks[part].astype(np.float64)
        chunk_w = None if weights is None else weights[part].astype(np.float64)
        q[part], scales[part] = _settled(x, _search(x, bits, chunk_w), bits, chunk_w)
    return _blocks(q, scales, n, k, bits, block_size)


def quantize_rtn(w: np.ndarray, bits: int, block_size: int = 32) -> Blocks:
    """Round-to-nearest: the extreme maps to ``-half``, the rest round against it (the
    baseline the search is measured against)."""
    n, k = _checked(w, block_size)
    x = np.ascontiguousarray(w, np.float32).reshape(-1, block_size).astype(np.float64)
    scales = _rtn_scales(x, bits)
    q, _ = _fitted(x, scales, bits, None)
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


def _checked_importance(importance: np.ndarray, n: int, k: int, block_size: int) -> np.ndarray:
    """``importance`` as one float64 weight per element, blocks along K."""
    weights = np.asarray(importance, np.float64)
    if weights.shape not in ((k,), (n, k)) or not np.isfinite(weights).all():
        raise ConversionError(
            f"importance must be finite weights of shape [{k}] or [{n}, {k}], not "
            f"{weights.shape}: recompute them from the calibration activations"
        )
    if (weights < 0).any():
        raise ConversionError("importance weights must be non-negative: recompute them")
    return np.broadcast_to(weights, (n, k)).reshape(-1, block_size)


def _extreme(blocks: np.ndarray) -> np.ndarray:
    """Each block's value of largest magnitude, with its sign."""
    at = np.abs(blocks).argmax(axis=1)[:, None]
    return np.take_along_axis(blocks, at, axis=1)[:, 0]


def _search(x: np.ndarray, bits: int, weights: np.ndarray | None) -> np.ndarray:
    """The best refitted scale per block of ``x`` [m, block] over the candidates, in
    float64: at 8 bits the candidates' errors differ by less than float32 resolves."""
    half = 1 << (bits - 1)
    extreme = _extreme(x)
    inverse = 1.0 / np.where(extreme == 0, 1.0, extreme)
    wx = x if weights is None else weights * x
    best_gain = np.full(len(x), -1.0)
    best_d = np.zeros(len(x))
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
    return best_d


def _settled(
    x: np.ndarray, d: np.ndarray, bits: int, weights: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Integers and float32 scales for the blocks ``x`` from the searched float64 scales
    ``d``: the integers re-rounded against the stored scale, a subnormal or zero scale's
    float32 neighbours tried, and round-to-nearest kept unless the search is strictly better
    (errors in float64)."""
    scales = d.astype(np.float32)  # |d| stays below the block's largest value: finite
    q, error = _fitted(x, scales, bits, weights)
    best = (scales, q, error)
    coarse = np.flatnonzero(np.abs(scales) < np.finfo(np.float32).tiny)
    if len(coarse):
        for toward in (-1.0, 1.0):
            near = np.nextafter(scales[coarse], np.float32(toward))
            _keep_better(x, coarse, near, bits, weights, best, ties=False)
    every = np.arange(len(x))
    _keep_better(x, every, _rtn_scales(x, bits), bits, weights, best, ties=True)
    return q, scales


def _keep_better(
    x: np.ndarray,
    rows: np.ndarray,
    candidate: np.ndarray,
    bits: int,
    weights: np.ndarray | None,
    best: tuple[np.ndarray, np.ndarray, np.ndarray],
    *,
    ties: bool,
) -> None:
    """Give the blocks ``rows`` the float32 scales ``candidate`` where their error is lower
    (or equal, with ``ties``) than in ``best`` = (scales, integers, errors), in place."""
    scales, q, error = best
    got_q, got_error = _fitted(x[rows], candidate, bits, None if weights is None else weights[rows])
    won = got_error <= error[rows] if ties else got_error < error[rows]
    at = rows[won]
    scales[at], q[at], error[at] = candidate[won], got_q[won], got_error[won]


def _rtn_scales(x: np.ndarray, bits: int) -> np.ndarray:
    """Round-to-nearest's float32 scale per block: the extreme maps to ``-half``."""
    return (_extreme(x) / -(1 << (bits - 1))).astype(np.float32)


def _fitted(
    x: np.ndarray, scales: np.ndarray, bits: int, weights: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The nearest integers in range to ``x / scale`` per block (0 for a zero scale), and
    each block's weighted squared error with them, both from float64: ``1 / scale`` of a
    subnormal float32 scale is past float32's range. A block whose ``scale * q`` passes
    float32's largest value (the runtime would compute infinity) has an infinite error."""
    half = 1 << (bits - 1)
    d = scales.astype(np.float64)[:, None]
    q = np.divide(x, d, out=np.zeros_like(x), where=d != 0)
    np.clip(np.rint(q, out=q), -half, half - 1, out=q)
    approx = d * q
    diff = (x - approx) ** 2
    if weights is not None:
        diff = diff * weights
    error = diff.sum(axis=1)
    error[(np.abs(approx) > _FLOAT32_MAX).any(axis=1)] = np.inf
    return q.astype(np.int8), error


def _targets(half: int) -> list[float]:
    return [-(half + t) for t in _NEGATIVE] + [half - 1 + t for t in _POSITIVE]


def _round(x: np.ndarray, factor: np.ndarray, half: int, out: np.ndarray) -> None:
    """``out = clip(rint(x * factor), -half, half - 1)`` per block, in place."""
    np.multiply(x, factor[:, None], out=out)
    np.rint(out, out=out)
    np.clip(out, -half, half - 1, out=out)
