"""Read safetensors files tensor by tensor through a memory map, without torch.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw data. Tensors are handed out as numpy
views of the map (BF16 is widened to float32, the one copy), so reading a model never holds
more than the tensor being converted.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer.errors import ConversionError

__all__ = ["SafetensorsIndex", "TensorEntry", "open_checkpoint"]

_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 on read
    "F64": np.dtype("<f8"),
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in the file
    end: int


class SafetensorsIndex:
    """Every tensor of a checkpoint folder (one or more .safetensors files), by name."""

    def __init__(self, entries: dict[str, TensorEntry]) -> None:
        self.entries = entries
        self._maps: dict[Path, mmap.mmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 or float16 (a view of the file where its type allows)."""
        entry = self.entries[name]
        buf = self._maps.get(entry.file)
        if buf is None:
            with entry.file.open("rb") as fh:
                buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[entry.file] = buf
        dtype = _DTYPES[entry.dtype]
        count = int(np.prod(entry.shape)) if entry.shape else 1
        if (entry.end - entry.start) != count * dtype.itemsize:
            raise ConversionError(f"{entry.file.name}: tensor {name} has a wrong byte range")
        data = np.frombuffer(buf, dtype=dtype, count=count, offset=entry.start)
        if entry.dtype == "BF16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.reshape(entry.shape)

    def release(self, name: str) -> None:
        """Drop the pages of ``name``'s bytes from this process's resident set (they stay in
        the page cache): a mapped file otherwise counts in full against the process's peak
        memory once every tensor has been read."""
        entry = self.entries[name]
        buf = self._maps.get(entry.file)
        advise = getattr(mmap, "MADV_DONTNEED", None)
        if buf is None or advise is None:
            return
        start = entry.start - entry.start % mmap.PAGESIZE
        if entry.end > start:
            buf.madvise(advise, start, entry.end - start)

    def close(self) -> None:
        for buf in self._maps.values():
            try:
                buf.close()
            except BufferError:  # a view is still alive; the map closes when it goes
                pass
        self._maps.clear()


@contextmanager
def open_checkpoint(folder: Path) -> Iterator[SafetensorsIndex]:
    files = sorted(folder.glob("*.safetensors"))
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():  # sharded: the index names the files (not consolidated.* copies)
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({folder / str(f) for f in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConversionError(f"{index_file} is not a safetensors index: {exc}") from exc
    elif len(files) > 1:
        files = [f for f in files if not f.name.startswith("consolidated")]
    if not files:
        raise ConversionError(f"{folder} has no .safetensors files")
    entries: dict[str, TensorEntry] = {}
    for path in files:
        for entry in _read_header(path):
            entries[entry.name] = entry
    index = SafetensorsIndex(entries)
    try:
        yield index
    finally:
        index.close()


def _read_header(path: Path) -> list[TensorEntry]:
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, 100 * 2**20):
            raise ConversionError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise ConversionError(f"{path}: unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: the safetensors header is not a JSON object")
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in _DTYPES:
            raise ConversionError(f"{path.name}: tensor {name} has dtype {dtype}, not supported")
        offsets, shape = info.get("data_offsets"), info.get("shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(shape, list)):
            raise ConversionError(f"{path.name}: tensor {name} has no valid offsets and shape")
        start, end = (int(x) for x in offsets)
        if not 0 <= start <= end <= size - base:
            raise ConversionError(f"{path.name}: tensor {name} lies outside the file")
        entries.append(
            TensorEntry(name, dtype, tuple(int(d) for d in shape), path, base + start, base + end)
        )
    return entries
