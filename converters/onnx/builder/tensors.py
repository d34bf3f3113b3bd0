"""The builder's tensor sources: what the graph functions read weights through.

``GGUFTensors`` reads a GGUF file; ``sources.hf_source.CheckpointTensors`` gives a
safetensors folder the same face (``TensorSource``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.gguf_file import GGUFHeader, TensorInfo

from .gguf_blocks import transcode

__all__ = ["BF16", "F16", "F32", "FLOAT_TYPES", "GGUFTensors", "TensorSource"]

F32, F16, BF16 = 0, 1, 30
FLOAT_TYPES = (F32, F16, BF16)


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
        process's resident set, and the build's peak is meant to be one tensor."""
        nbytes = t.nbytes
        if nbytes is None:
            raise ConversionError(f"tensor {t.name}: unknown GGML type {t.ggml_type}")
        with open(self.header.path, "rb") as fh:
            fh.seek(self.header.data_offset + t.offset)
            data = np.frombuffer(fh.read(nbytes), dtype=np.uint8)
        if len(data) != nbytes:
            raise ConversionError(f"{self.header.path.name}: tensor {t.name} is cut short")
        if t.name not in self.seen:
            self.seen.add(t.name)
            self.on_read()
        return data

    def floats(self, t: TensorInfo) -> np.ndarray:
        """The tensor as float32 with numpy dims (outer first), dequantized when needed."""
        dims = tuple(reversed(t.shape))
        raw = self.raw(t)
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
