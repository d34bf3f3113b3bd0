"""GGUF quantized weights as onnxruntime ``MatMulNBits`` inputs, without re-rounding.

llama.cpp stores a weight ``[N, K]`` as N rows of whole blocks along K. Each GGUF block type
maps exactly onto ``MatMulNBits`` blocks (``x = scale * (u - zero_point)``, unsigned ``u`` of
4 or 8 bits, blocks of 16 or 32 along K) plus, for the types with a per-block minimum
(Q4_1, Q5_1, Q4_K, Q5_K), an additive term ``offset`` per 32 elements:

    W[n, k] = scale[n, k // bs] * (u[n, k] - zp[n, k // bs]) + offset[n, k // 32]
    A @ W.T = MatMulNBits(A) + blocksum32(A) @ offset.T

where ``blocksum32(A)`` sums the activations over each 32-wide block of K. Both terms are
exact: the values are those llama.cpp dequantizes, up to float32 rounding.

| GGUF | bits | block | u | zero point | offset |
| --- | --- | --- | --- | --- | --- |
| Q4_0 | 4 | 32 | q | 8 | - |
| Q4_1 | 4 | 32 | q | 8 | m + 8 d |
| Q5_0 | 8 | 32 | q5 + 112 | 128 | - |
| Q5_1 | 8 | 32 | q5 + 128 | 128 | m |
| Q8_0 | 8 | 32 | q + 128 | 128 | - |
| Q4_K | 4 | 32 | q | 8 | 8 d sc_j - dmin m_j |
| Q5_K | 8 | 32 | q5 + 128 | 128 | -dmin m_j |
| Q6_K | 8 | 16 | q6 + 96 | 128 | - |

Every zero point is MatMulNBits' default (2**(bits-1)), left out of the graph: with explicit
zero points its CPU kernel took 1.8x as long.

5- and 6-bit values are stored in 8 bits: MatMulNBits has no 5- or 6-bit kernels, and its
8-bit kernel is exact for them. Other types (IQ*, Q2_K, Q3_K, TQ*) return None: the caller
widens them to floats and says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from edgeinfer.files.gguf_file import TensorInfo

__all__ = [
    "FORMS",
    "OFFSET_BLOCK",
    "TRANSCODABLE",
    "BlockForm",
    "NBitsWeight",
    "transcode",
    "transcode_reads",
]

OFFSET_BLOCK = 32  # the offset term's block width along K, for every type that has one

# GGML type ids (ggml.h): the block types this module maps
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K = 12, 13, 14
QK_K = 256

# type -> (elements per block, bytes per block)
_BLOCKS = {
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q8_0: (32, 34),
    Q4_K: (QK_K, 144),
    Q5_K: (QK_K, 176),
    Q6_K: (QK_K, 210),
}
TRANSCODABLE = frozenset(_BLOCKS)


@dataclass(frozen=True)
class BlockForm:
    """What a tensor becomes, known before a byte of it is read: MatMulNBits' width and
    block size, and whether an offset term comes with it."""

    bits: int
    block_size: int
    offset: bool = False

    @property
    def kernel(self) -> tuple[int, int]:
        """(bits, block size): projections of one kernel share one MatMulNBits."""
        return self.bits, self.block_size

    def nbytes(self, elements: int) -> float:
        """Bytes of ``elements`` weights in this form: the values, a float32 scale per
        block, a float32 offset per 32 where there is one."""
        per_element = self.bits / 8 + 4 / self.block_size
        return elements * (per_element + (4 / OFFSET_BLOCK if self.offset else 0.0))


# type -> its form, the table above as data (``transcode`` returns weights of this form)
FORMS = {
    Q4_0: BlockForm(4, 32),
    Q4_1: BlockForm(4, 32, offset=True),
    Q5_0: BlockForm(8, 32),
    Q5_1: BlockForm(8, 32, offset=True),
    Q8_0: BlockForm(8, 32),
    Q4_K: BlockForm(4, 32, offset=True),
    Q5_K: BlockForm(8, 32, offset=True),
    Q6_K: BlockForm(8, 16),
}


@dataclass(frozen=True)
class NBitsWeight:
    """One ``[n, k]`` weight as MatMulNBits inputs plus the optional offset term."""

    n: int
    k: int
    bits: int
    block_size: int
    packed: np.ndarray  # uint8 [n, k // block_size, block_size * bits // 8]
    scales: np.ndarray  # float32 [n, k // block_size]
    offset: np.ndarray | None  # float32 [n, k // OFFSET_BLOCK], added per 32-wide block

    def unsigned(self) -> np.ndarray:
        """The stored integers ``u`` as uint8 ``[n, k]``."""
        if self.bits == 8:
            return self.packed.reshape(self.n, self.k)
        low = self.packed & 0x0F
        high = self.packed >> 4
        return np.stack([low, high], axis=-1).reshape(self.n, self.k)

    def dequantize(self) -> np.ndarray:
        """The weight as float32 ``[n, k]``, computed as the ONNX graph computes it."""
        blocks = self.k // self.block_size
        u = self.unsigned().astype(np.float32).reshape(self.n, blocks, self.block_size)
        zero_point = float(1 << (self.bits - 1))  # MatMulNBits' default
        w = (self.scales[..., None] * (u - zero_point)).reshape(self.n, self.k)
        if self.offset is not None:
            w = w + np.repeat(self.offset, OFFSET_BLOCK, axis=1)
        return w


def transcode(ggml_type: int, raw: np.ndarray, n: int, k: int) -> NBitsWeight | None:
    """The GGUF tensor ``raw`` (its bytes, ``n`` rows of ``k`` elements) as MatMulNBits
    blocks, or None when its type has no exact mapping."""
    if ggml_type not in _BLOCKS:
        return None
    elems, size = _BLOCKS[ggml_type]
    if k % elems:
        raise ValueError(f"a row of {k} elements is not whole blocks of {elems}")
    nb = k // elems
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, nb, size)
    return _MAPPERS[ggml_type](data, n, k)


def transcode_reads(tensors: Iterable[TensorInfo]) -> float:
    """The bytes a one-token step of the exact transcode reads, over the GGUF's: every
    matrix but the embedding (which a step gathers a row of), the embedding too where it is
    the output head (tied). A type without a form is read as float32 (the builder widens
    it). 1.0 when there is no matrix."""
    matrices = [t for t in tensors if len(t.shape) == 2]
    tied = all(t.name != "output.weight" for t in matrices)
    source = transcoded = 0.0
    for t in matrices:
        if t.name == "token_embd.weight" and not tied:
            continue
        elements = t.shape[0] * t.shape[1]
        form = FORMS.get(t.ggml_type)
        source += t.nbytes or 0
        transcoded += form.nbytes(elements) if form is not None else 4.0 * elements
    return transcoded / source if source else 1.0


# -- block readers (each returns the per-element integers and the per-block floats) ----------


def _f16(data: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block, as float32 ``[n, nb]``."""
    return np.ascontiguousarray(data[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block, element j in the low nibble of byte j and element j+16 in its high
    nibble (Q4_0/Q4_1/Q5_x order) -> uint8 [..., 32] in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """The 4-byte little-endian bit field of Q5_0/Q5_1 -> bit j of it for j in 0..31."""
    word = np.ascontiguousarray(qh).view("<u4")[..., 0]
    return ((word[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K -> (8 six-bit scales, 8 six-bit mins) per block."""
    s = s.astype(np.uint8)
    sc = np.empty((*s.shape[:-1], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes of Q4_K/Q5_K -> 256 four-bit values: for each 32-byte chunk c, the low
    nibbles are elements 64c..64c+31 and the high nibbles 64c+32..64c+63."""
    chunks = qs.reshape((*qs.shape[:-1], 4, 32))
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape((*qs.shape[:-1], 256))


# -- packers ---------------------------------------------------------------------------------


def _weight(
    u: np.ndarray,
    scales: np.ndarray,
    n: int,
    k: int,
    bits: int,
    block_size: int,
    offset: np.ndarray | None,
) -> NBitsWeight:
    """Pack ``u`` (uint8 [n, k]) as MatMulNBits reads it: 8-bit as is; 4-bit two per byte,
    element 2i in the low nibble."""
    blocks = k // block_size
    if bits == 8:
        packed = u.reshape(n, blocks, block_size)
    else:
        pairs = u.reshape(n, blocks, block_size // 2, 2)
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return NBitsWeight(
        n=n,
        k=k,
        bits=bits,
        block_size=block_size,
        packed=np.ascontiguousarray(packed, dtype=np.uint8),
        scales=np.ascontiguousarray(scales.reshape(n, blocks), dtype=np.float32),
        offset=None if offset is None else np.ascontiguousarray(offset.reshape(n, -1), np.float32),
    )


def _q4_0(data: np.ndarray, n: int, k: int) -> NBitsWeight:
    u = _nibbles_split(data[..., 2:18])
    return _weight(u.reshape(n, k), _f16(data, 0), n, k, 4, 32, offset=None)


def _q4_1(data: np.ndarray, n: int, k: int) -> NBitsWeight:
    u = _nibbles_split(data[..., 4:20])
    d = _f16(data, 0)  # d q + m = d (q - 8) + (m + 8 d)
    return _weight(u.reshape(n, k), d, n, k, 4, 32, offset=_f16(data, 2) + 8 * d)


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return _nibbles_split(qs) | (_high_bits_32(qh) << 4)


def _q5_0(data: np.ndarray, n: int, k: int) -> NBitsWeight:
    u = _q5(data[..., 2:6], data[..., 6:22]) + np.uint8(112)  # u - 128 = q5 - 16
    return _weight(u.reshape(n, k), _f16(data, 0), n, k, 8, 32, offset=None)


def _q5_1(data: np.ndarray, n: int, k: int) -> NBitsWeight:
    u = _q5(data[..., 4:8], data[..., 8:24]) + np.uint8(128)  # u - 128 = q5
    return _weight(u.reshape(n, k), _f16(data, 0), n, k, 8, 32, offset=_f16(data, 2))


def _q8_0(data: np.ndarray, n: int, k: int) -> NBitsWeight:
    u = data[..., 2:34] ^ np.uint8(0x80)  # int8 q -> q + 128
    return _weight(u.reshape(n, k), _f16(data, 0), n, k, 8, 32, offset=None)


def _k_common(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-wide sub-block: (scale d * sc_j, offset -dmin * m_j), float32 [n, nb, 8]."""
    d, dmin = _f16(data, 0), _f16(data, 2)
    sc, mn = _k_scales(data[..., 4:16])
    return d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))


def _q4_k(data: np.ndarray, n: int, k: int) -> NBitsWeight:
    scales, offset = _k_common(data)
    u = _k_nibbles(data[..., 16:144])  # s q - min = s (q - 8) + (8 s - min)
    return _weight(u.reshape(n, k), scales, n, k, 4, 32, offset=offset + 8 * scales)


def _q5_k(data: np.ndarray, n: int, k: int) -> NBitsWeight:
    scales, offset = _k_common(data)
    low = _k_nibbles(data[..., 48:176]).reshape((*data.shape[:-1], 8, 32))
    qh = data[..., 16:48]  # element i of sub-block j takes bit j of qh[i]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    u = (low | (high << 4)) + np.uint8(128)  # u - 128 = q5
    return _weight(u.reshape(n, k), scales, n, k, 8, 32, offset=offset)


def _q6_k(data: np.ndarray, n: int, k: int) -> NBitsWeight:
    ql = data[..., 0:128].reshape((*data.shape[:-1], 2, 64))
    qh = data[..., 128:192].reshape((*data.shape[:-1], 2, 32))
    sc = np.ascontiguousarray(data[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(data, 208)
    q = np.concatenate(
        [
            (ql[..., 0:32] & 0x0F) | ((qh & 3) << 4),
            (ql[..., 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
            (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4),
            (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4),
        ],
        axis=-1,
    )  # [n, nb, 2, 128]: element order within each half
    u = q.reshape(n, k) + np.uint8(96)  # u - 128 = q6 - 32
    return _weight(u, d[..., None] * sc, n, k, 8, 16, offset=None)


_MAPPERS = {
    Q4_0: _q4_0,
    Q4_1: _q4_1,
    Q5_0: _q5_0,
    Q5_1: _q5_1,
    Q8_0: _q8_0,
    Q4_K: _q4_k,
    Q5_K: _q5_k,
    Q6_K: _q6_k,
}


def quantize_symmetric(w: np.ndarray, bits: int, block_size: int = 32) -> NBitsWeight:
    """Float weights ``[n, k]`` rounded to symmetric ``bits``-bit blocks (MatMulNBits'
    default zero point): per block, the value of largest magnitude maps to the most negative
    integer, as llama.cpp's Q4_0/Q8_0 quantizers and onnxruntime's do. This re-rounds: it is
    what ``--quant int4``/``int8`` ask for, never the default for a GGUF source."""
    n, k = w.shape
    if k % block_size:
        raise ValueError(f"a row of {k} elements is not whole blocks of {block_size}")
    half = 1 << (bits - 1)
    blocks = w.reshape(n, k // block_size, block_size).astype(np.float32)
    at = np.abs(blocks).argmax(axis=-1)[..., None]
    extreme = np.take_along_axis(blocks, at, axis=-1)[..., 0]
    scales = extreme / -half
    inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales != 0)
    q = np.clip(np.rint(blocks * inverse[..., None]) + half, 0, 2 * half - 1).astype(np.uint8)
    return _weight(q.reshape(n, k), scales, n, k, bits, block_size, offset=None)
