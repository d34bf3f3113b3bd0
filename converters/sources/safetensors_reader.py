"""Read safetensors files tensor by tensor through a memory map, without torch.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw data. Tensors are handed out as numpy
views of the map (BF16 is widened to float32, the one copy), so reading a model never holds
more than the tensor being converted.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import ConversionError

__all__ = ["SafetensorsIndex", "TensorEntry", "open_checkpoint", "read_safetensors_header"]

_MAX_HEADER = 100 * 2**20  # bytes of JSON; real headers are well under 1 MB
_MAX_RANK = 8
# bytes a tensor's non-zero dimensions may span: numpy refuses (ValueError, not a clean
# error) any shape whose size overflows, even when another dimension is 0
_MAX_SPAN = 1 << 48
# every safetensors dtype -> bytes per element (headers are checked for all of them)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
             "F64": 8}  # fmt: skip
# the dtypes the reader hands out, as stored in the file
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

    @property
    def nbytes(self) -> int:
        return self.end - self.start


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
        dtype = _DTYPES.get(entry.dtype)
        if dtype is None:
            raise ConversionError(
                f"{entry.file.name}: tensor {name!r:.80} is {entry.dtype}; only F32, F16, BF16 "
                "and F64 weights can be converted"
            )
        buf = self._map(entry.file)
        if entry.end > len(buf):  # the file shrank after its header was read
            raise ConversionError(f"{entry.file}: tensor {name!r:.80} lies past the file's end")
        count = math.prod(entry.shape)
        data = np.frombuffer(buf, dtype=dtype, count=count, offset=entry.start)
        if entry.dtype == "BF16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.reshape(entry.shape)

    def _map(self, path: Path) -> mmap.mmap:
        buf = self._maps.get(path)
        if buf is None:
            try:
                with path.open("rb") as fh:
                    buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                raise ConversionError(f"cannot map {path} into memory: {exc}") from exc
            self._maps[path] = buf
        return buf

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
        end = min(entry.end, len(buf))
        if end > start:
            buf.madvise(advise, start, end - start)

    def close(self) -> None:
        for buf in self._maps.values():
            try:
                buf.close()
            except BufferError:  # a view is still alive; the map closes when it goes
                pass
        self._maps.clear()


@contextmanager
def open_checkpoint(folder: Path) -> Iterator[SafetensorsIndex]:
    """The tensors of every safetensors file of ``folder``, their headers checked."""
    entries: dict[str, TensorEntry] = {}
    for path in _weight_files(folder):
        for entry in read_safetensors_header(path):
            if entry.name in entries:
                raise ConversionError(
                    f"{folder}: tensor {entry.name!r:.80} is in both "
                    f"{entries[entry.name].file.name} and {path.name}"
                )
            entries[entry.name] = entry
    index = SafetensorsIndex(entries)
    try:
        yield index
    finally:
        index.close()


def _weight_files(folder: Path) -> list[Path]:
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():  # sharded: the index names the files (not consolidated.* copies)
        return _indexed_files(folder, index_file)
    files = sorted(folder.glob("*.safetensors"))
    if len(files) > 1:
        files = [f for f in files if not f.name.startswith("consolidated")]
    if not files:
        raise ConversionError(f"{folder} has no .safetensors files")
    return files


def _indexed_files(folder: Path, index_file: Path) -> list[Path]:
    """The shard files ``index_file`` names, each inside ``folder`` (symlinks resolved)."""
    try:
        weight_map = json.loads(index_file.read_bytes())["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError, OSError) as exc:
        raise ConversionError(f"{index_file} is not a safetensors index: {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{index_file}: weight_map must be a non-empty JSON object")
    root = folder.resolve()
    files = set()
    for tensor, name in weight_map.items():
        path = (folder / name).resolve() if isinstance(name, str) and name else None
        if path is None or not path.is_relative_to(root):
            raise ConversionError(
                f"{index_file}: tensor {tensor!r:.80} names {name!r:.80}, not a file inside "
                f"{folder}"
            )
        if not path.is_file():
            raise ConversionError(f"{index_file} names {name!r:.80}, which is missing")
        files.add(path)
    return sorted(files)


def read_safetensors_header(path: Path) -> list[TensorEntry]:
    """Every tensor ``path``'s header describes, each checked against the file: a known
    dtype, a shape whose size matches its byte range, a range inside the file's data, no two
    ranges overlapping, no name twice. Anything else is a ConversionError naming the tensor."""
    size, raw = _header_bytes(path)
    header = _parse_header(path, raw)
    base = 8 + len(raw)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise ConversionError(f"{path}: __metadata__ must be a JSON object")
    entries = [_entry(path, name, info, base, size) for name, info in header.items()]
    _check_overlaps(path, entries)
    return entries


def _header_bytes(path: Path) -> tuple[int, bytes]:
    """(file size, the JSON header's bytes)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ConversionError(f"{path} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, _MAX_HEADER):
                raise ConversionError(
                    f"{path} is not a safetensors file (header length {length} in a file of "
                    f"{size} bytes)"
                )
            raw = fh.read(length)
    except OSError as exc:
        raise ConversionError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) < length:
        raise ConversionError(f"{path} is truncated inside its header")
    return size, raw


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(f"{key!r:.80} appears twice")
        result[key] = value
    return result


def _parse_header(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ConversionError(f"{path}: unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: the safetensors header is not a JSON object")
    return header


def _entry(path: Path, name: str, info: Any, base: int, size: int) -> TensorEntry:
    where = f"{path.name}: tensor {name!r:.80}"
    if not isinstance(info, dict):
        raise ConversionError(f"{where} is described by {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise ConversionError(f"{where} has dtype {dtype!r:.40}, not a safetensors dtype")
    if not (isinstance(shape, list) and len(shape) <= _MAX_RANK and all(map(_is_size, shape))):
        raise ConversionError(f"{where} has shape {shape!r:.80}, not a list of sizes")
    if math.prod(d for d in shape if d) * _ITEMSIZE[dtype] > _MAX_SPAN:
        raise ConversionError(f"{where} has shape {shape!r:.80}, larger than any tensor can be")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_size, offsets))):
        raise ConversionError(f"{where} has data_offsets {offsets!r:.80}, not [start, end]")
    start, end = offsets
    if not start <= end <= size - base:
        raise ConversionError(
            f"{where} has bytes {start}..{end}, outside the file's {size - base} data bytes"
        )
    needed = math.prod(shape) * _ITEMSIZE[dtype]
    if end - start != needed:
        raise ConversionError(
            f"{where} holds {end - start} bytes but {dtype} {tuple(shape)} needs {needed}"
        )
    return TensorEntry(name, dtype, tuple(shape), path, base + start, base + end)


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_overlaps(path: Path, entries: list[TensorEntry]) -> None:
    last: TensorEntry | None = None
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if last is not None and entry.start < last.end and entry.nbytes:
            raise ConversionError(
                f"{path.name}: tensors {last.name!r:.80} and {entry.name!r:.80} overlap in the file"
            )
        if last is None or entry.end > last.end:
            last = entry
