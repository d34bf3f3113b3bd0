"""The builder's tensor sources: what the graph functions read weights through.

``GGUFTensors`` reads a GGUF file; ``sources.hf_source.CheckpointTensors`` gives a
safetensors folder the same face (``TensorSource``). A GGUF's weights are read a band of rows
at a time (``raw_bands``, ``float_bands``): the build's working set is a band, not a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.files.gguf_file import GGUFHeader, TensorInfo

from .gguf_blocks import transcode

__all__ = [
    "BAND_ELEMENTS",
    "BF16",
    "F16",
    "F32",
    "FLOAT_TYPES",
    "GGUFTensors",
    "TensorSource",
    "float_bands",
    "raw_bands",
    "spans",
]

F32, F16, BF16 = 0, 1, 30
FLOAT_TYPES = (F32, F16, BF16)
BAND_ELEMENTS = 1 << 22  # weights read and converted at a time (16 MiB as float32)


class TensorSource(Protocol):
    header: GGUFHeader
    on_read: Callable[[], None]  # called once per tensor, the first time it is read
    seen: set[str]  # names read so far

    def info(self, name: str) -> TensorInfo | None: ...

    def raw(self, t: TensorInfo) -> np.ndarray: ...

    def floats(self, t: TensorInfo) -> np.ndarray: ...


class GGUFTensors:
    """The GGUF file's tensors, one at a time as numpy arrays."""

    def __init__(self, header: GGUFHeader, on_read: Callable[[], None]) -> None:
        self.header = header
        self._by_name = {t.name: t for t in header.tensors}
        self.on_read = on_read
        self.seen: set[str] = set()

    def info(self, name: str) -> TensorInfo | None:
        return self._by_name.get(name)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes, read on their own: pages of a memory map would stay in the
        process's resident set, and the build's peak is meant to be one band of rows."""
        nbytes = t.nbytes
        if nbytes is None:
            raise ConversionError(f"tensor {t.name}: unknown GGML type {t.ggml_type}")
        return self._read(t, 0, nbytes)

    def rows(self, t: TensorInfo, start: int, stop: int) -> np.ndarray:
        """The bytes of rows ``start .. stop`` of the 2-D tensor ``t`` (rows are whole blocks)."""
        if t.nbytes is None:
            raise ConversionError(f"tensor {t.name}: unknown GGML type {t.ggml_type}")
        row = t.nbytes // t.shape[1]
        return self._read(t, start * row, (stop - start) * row)

    def _read(self, t: TensorInfo, at: int, nbytes: int) -> np.ndarray:
        with open(self.header.path, "rb") as fh:
            fh.seek(self.header.data_offset + t.offset + at)
            data = np.frombuffer(fh.read(nbytes), dtype=np.uint8)
        if len(data) != nbytes:
            raise ConversionError(f"{self.header.path.name}: tensor {t.name} is cut short")
        if t.name not in self.seen:
            self.seen.add(t.name)
            self.on_read()
        return data

    def floats(self, t: TensorInfo) -> np.ndarray:
        """The tensor as float32 with numpy dims (outer first), dequantized when needed."""
        return _as_floats(t, self.raw(t), tuple(reversed(t.shape)))

    def float_rows(self, t: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Rows ``start .. stop`` of the 2-D tensor ``t`` as float32 [rows, k]."""
        return _as_floats(t, self.rows(t, start, stop), (stop - start, t.shape[0]))


def spans(n: int, k: int) -> Iterator[tuple[int, int]]:
    """Bands of rows (start, stop) of an [n, k] weight, ``BAND_ELEMENTS`` weights or one row
    at a time."""
    step = max(1, BAND_ELEMENTS // max(k, 1))
    for start in range(0, n, step):
        yield start, min(n, start + step)


def raw_bands(source: TensorSource, t: TensorInfo) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, bytes of a band of rows) of the 2-D block tensor ``t``."""
    k, n = t.shape
    if not isinstance(source, GGUFTensors):  # blocks come from GGUF files alone
        yield 0, source.raw(t)
        return
    for start, stop in spans(n, k):
        yield start, source.rows(t, start, stop)


def float_bands(source: TensorSource, t: TensorInfo) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 [rows, k]) of the 2-D tensor ``t``, a band at a time; a source
    that reads whole tensors gives its tensor's bands."""
    k, n = t.shape
    if isinstance(source, GGUFTensors):
        for start, stop in spans(n, k):
            yield start, source.float_rows(t, start, stop)
        return
    whole = source.floats(t)
    for start, stop in spans(n, k):
        yield start, whole[start:stop]


def _as_floats(t: TensorInfo, raw: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """``raw`` (bytes of ``t``, or of some of its rows) as float32 ``dims``."""
    if t.ggml_type == F32:
        return raw.view(np.float32).reshape(dims).astype(np.float32)
    if t.ggml_type == F16:
        return raw.view(np.float16).reshape(dims).astype(np.float32)
    if t.ggml_type == BF16:
        bits = raw.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(dims)
    if len(dims) == 2:
        weight = transcode(t.ggml_type, raw, dims[0], dims[1])
        if weight is not None:
            return weight.dequantize()
    return _dequantize_with_gguf(t, raw, dims)


def _dequantize_with_gguf(t: TensorInfo, raw: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """Block types without an exact MatMulNBits form, widened by the gguf package."""
    try:
        from gguf.quants import dequantize
    except ImportError as exc:
        raise ConversionError(
            f"tensor {t.name} is GGML type {t.ggml_type}; widening it needs the gguf "
            "package: pip install 'edgeinfer[convert]'"
        ) from exc
    return np.asarray(dequantize(raw.reshape(dims[0], -1), t.ggml_type), np.float32).reshape(dims)
