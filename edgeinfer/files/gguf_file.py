"""Read the header of a GGUF file without an engine: metadata, tensor table, completeness.

The engine (llama.cpp) aborts the process on some malformed files, so every GGUF file is
checked here first: magic, version, a parseable header, and tensor data that lies inside the
file. The metadata read here also feeds the chat template and the memory planner.
"""

from __future__ import annotations

import itertools
import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_ALIGNMENT = 1 << 20
_MAX_DIMS = 8
# Arrays longer than this (vocabularies, merges) are skipped, not materialised.
_MAX_ARRAY_KEPT = 1024
# Strings longer than this (a whole tokenizer.json some converters embed) are skipped too.
_MAX_STRING_KEPT = 1 << 20
# Metadata the planner and the backends read as numbers: (key suffix -> largest sane value).
# Present keys must hold one non-negative integer; per-layer arrays are not supported.
_ARCH_INT_LIMITS = {
    "block_count": 1 << 12,
    "context_length": 1 << 24,
    "embedding_length": 1 << 17,
    "attention.head_count": 1 << 12,
    "attention.head_count_kv": 1 << 12,
    "attention.key_length": 1 << 14,
    "attention.value_length": 1 << 14,
    "vocab_size": 1 << 22,
}
_TEXT_KEYS = ("general.architecture", "tokenizer.chat_template")

# GGUF metadata value types -> struct format (None: variable length).
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_TOKENS = "tokenizer.ggml.tokens"

# ggml tensor type -> (elements per block, bytes per block).
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    9: (32, 36),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    15: (256, 292),
    16: (256, 66),
    17: (256, 74),
    18: (256, 98),
    19: (256, 50),
    20: (32, 18),
    21: (256, 110),
    22: (256, 82),
    23: (256, 136),
    24: (1, 1),
    25: (1, 2),
    26: (1, 4),
    27: (1, 8),
    28: (1, 8),
    29: (256, 56),
    30: (1, 2),
    34: (256, 54),
    35: (256, 66),
    39: (32, 17),
}


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array too long to keep in memory: its element type and length."""

    element_type: int
    length: int


@dataclass(frozen=True)
class StringInfo:
    """A metadata string too long to keep in memory: its length in bytes."""

    length: int


@dataclass(frozen=True)
class TokenFacts:
    """What llama.cpp and the builder need to know of the token strings' raw bytes."""

    duplicate: tuple[int, int] | None  # the first two ids spelled the same (llama.cpp aborts)
    not_utf8: int | None  # the first id whose bytes are not UTF-8


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # bytes from the start of the data section

    @property
    def nbytes(self) -> int | None:
        """Bytes of tensor data, or None for a type this reader does not know."""
        block = GGML_BLOCK_SIZES.get(self.ggml_type)
        if block is None:
            return None
        n_elements = 1
        for dim in self.shape:
            n_elements *= dim
        return n_elements // block[0] * block[1]


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    file_size: int
    data_offset: int
    metadata: dict[str, Any] = field(repr=False)
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    # array key -> GGUF element type (kept lists lose it: a list of ints may be u8 or i32)
    array_types: dict[str, int] = field(default_factory=dict, repr=False)
    token_facts: TokenFacts | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A per-architecture value such as ``context_length`` (``llama.context_length``)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def weight_nbytes(self) -> int:
        return sum(t.nbytes or 0 for t in self.tensors)


class _Cursor:
    """Sequential little-endian reader over a memory map; raises ModelLoadError at the end."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self._buf = buf
        self._path = path
        self.pos = 0
        self.last_array_type = -1  # element type of the array read last

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self._buf):
            raise ModelLoadError(
                f"{self._path}: GGUF header is truncated or corrupt (needs {n:,} bytes at offset "
                f"{self.pos:,}, file has {len(self._buf):,}); re-download or re-convert the model"
            )

    def corrupt(self, why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{self._path}: GGUF header is corrupt at offset {self.pos:,}: {why}; re-download "
            "or re-convert the model"
        )

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str | StringInfo:
        """A string value; invalid UTF-8 is replaced (some vocabularies hold such tokens)."""
        length = self.unpack("<Q")
        self._need(length)
        if length > _MAX_STRING_KEPT:
            self.pos += length
            return StringInfo(length)
        return self._take(length).decode("utf-8", errors="replace")

    def name(self, what: str) -> str:
        """A key or tensor name: short, valid UTF-8."""
        length = self.unpack("<Q")
        self._need(length)
        if length > 65535:
            raise self.corrupt(f"a {what} of {length:,} bytes")
        raw = self._take(length)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.corrupt(f"a {what} that is not UTF-8 ({raw[:40]!r})") from exc

    def _take(self, length: int) -> bytes:
        raw = self._buf[self.pos : self.pos + length]
        self.pos += length
        return raw

    def skip_string(self) -> None:
        length = self.unpack("<Q")
        self._need(length)
        self.pos += length

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        raise self.corrupt(f"unknown metadata value type {value_type}")

    def array(self, *, whole: bool = False) -> list[Any] | ArrayInfo:
        """An array's elements; past _MAX_ARRAY_KEPT only its type and length unless
        ``whole`` (the vocabulary a converter reads)."""
        element_type = self.unpack("<I")
        length = self.unpack("<Q")
        self.last_array_type = element_type
        if element_type == _ARRAY:  # llama.cpp refuses them too
            raise self.corrupt("an array of arrays")
        if element_type != _STRING and element_type not in _SCALAR_FORMATS:
            raise self.corrupt(f"an array of unknown type {element_type}")
        # every element takes at least this many bytes: a huge length fails here, at once
        smallest = 8 if element_type == _STRING else struct.calcsize(_SCALAR_FORMATS[element_type])
        self._need(length * smallest)
        if whole and element_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[element_type]
            nbytes = length * struct.calcsize(fmt)
            values = struct.unpack_from(f"<{length}{fmt[1:]}", self._buf, self.pos)
            self.pos += nbytes
            return list(values)
        if length <= _MAX_ARRAY_KEPT or whole:
            return [self.value(element_type) for _ in range(length)]
        if element_type in _SCALAR_FORMATS:
            nbytes = length * struct.calcsize(_SCALAR_FORMATS[element_type])
            self._need(nbytes)
            self.pos += nbytes
        else:
            for _ in range(length):
                self.skip_string()
        return ArrayInfo(element_type, length)


def read_gguf_header(path: str | Path, *, whole_arrays: Collection[str] = ()) -> GGUFHeader:
    """Parse a GGUF file's header and tensor table; raise ModelLoadError if it is not one.
    Long arrays are kept as ArrayInfo, except those named in ``whole_arrays``."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            file_size = path.stat().st_size
            if file_size < 24:
                raise ModelLoadError(f"{path}: too small to be a GGUF model ({file_size} bytes)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path, file_size, frozenset(whole_arrays))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _parse(
    buf: mmap.mmap, path: Path, file_size: int, whole: frozenset[str] = frozenset()
) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (starts with {bytes(buf[:4])!r}, expected b'GGUF')"
        )
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in _SUPPORTED_VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3 are)")
    n_tensors = cur.unpack("<Q")
    n_kv = cur.unpack("<Q")
    # a key takes >= 12 bytes, a tensor entry >= 24: larger counts cannot fit in the file
    if n_tensors * 24 > file_size or n_kv * 12 > file_size:
        raise cur.corrupt(f"{n_tensors:,} tensors and {n_kv:,} keys cannot fit in the file")
    array_types: dict[str, int] = {}
    starts: dict[str, int] = {}
    metadata = _read_metadata(cur, n_kv, whole, array_types, starts)
    alignment = _alignment(cur, metadata)
    tensors = _read_tensor_table(cur, n_tensors, alignment)
    data_offset = -(-cur.pos // alignment) * alignment
    facts = None
    if array_types.get(_TOKENS) == _STRING:
        facts = _token_facts(buf, starts[_TOKENS])
    header = GGUFHeader(
        path, version, file_size, data_offset, metadata, tensors, array_types, facts
    )
    _check_complete(header)
    return header


def _read_metadata(
    cur: _Cursor,
    n_kv: int,
    whole: frozenset[str],
    array_types: dict[str, int],
    starts: dict[str, int],
) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.name("key")
        if key in metadata:
            raise cur.corrupt(f"key {key!r} appears twice")
        value_type = cur.unpack("<I")
        starts[key] = cur.pos
        if value_type == _ARRAY and key in whole:
            metadata[key] = cur.array(whole=True)
        else:
            metadata[key] = cur.value(value_type)
        if value_type == _ARRAY:
            array_types[key] = cur.last_array_type
    _check_known_values(cur, metadata)
    return metadata


def _token_facts(buf: mmap.mmap, pos: int) -> TokenFacts:
    """Duplicates and non-UTF-8 among the token strings of the (already validated) array at
    ``pos``, compared as llama.cpp compares them: raw bytes, an empty token read as
    ``[EMPTY_<id>]``."""
    (length,) = struct.unpack_from("<Q", buf, pos + 4)
    pos += 12
    seen: dict[bytes, int] = {}
    duplicate: tuple[int, int] | None = None
    not_utf8: int | None = None
    for i in range(length):
        (size,) = struct.unpack_from("<Q", buf, pos)
        raw = buf[pos + 8 : pos + 8 + size] or b"[EMPTY_%d]" % i
        pos += 8 + size
        if duplicate is None:
            first = seen.setdefault(raw, i)
            duplicate = (first, i) if first != i else None
        if not_utf8 is None and not raw.isascii():
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                not_utf8 = i
    return TokenFacts(duplicate, not_utf8)


def _check_known_values(cur: _Cursor, metadata: dict[str, Any]) -> None:
    """The values edgeinfer itself reads must have the type and range it reads them as."""
    for key in _TEXT_KEYS:
        if key in metadata and not isinstance(metadata[key], str):
            raise cur.corrupt(f"{key} must be a string of at most {_MAX_STRING_KEPT:,} bytes")
    arch = metadata.get("general.architecture", "unknown")
    for suffix, high in _ARCH_INT_LIMITS.items():
        key = f"{arch}.{suffix}"
        value = metadata.get(key, 0)
        if type(value) is not int or not 0 <= value <= high:
            shown = repr(value) if not isinstance(value, list) else f"a list of {len(value)}"
            raise cur.corrupt(f"{key}={shown[:60]} must be an integer from 0 to {high:,}")


def _alignment(cur: _Cursor, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or not 0 < alignment <= _MAX_ALIGNMENT:
        raise cur.corrupt(f"general.alignment={alignment!r:.60} is not a sane alignment")
    if alignment & (alignment - 1):
        raise cur.corrupt(f"general.alignment={alignment} is not a power of two")
    return alignment


def _read_tensor_table(cur: _Cursor, n_tensors: int, alignment: int) -> tuple[TensorInfo, ...]:
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        tensor = _read_tensor_info(cur)
        if tensor.name in names:
            raise cur.corrupt(f"tensor {tensor.name!r} appears twice")
        if tensor.offset % alignment:
            raise cur.corrupt(
                f"tensor {tensor.name!r} starts at {tensor.offset:,}, not a multiple of the "
                f"alignment {alignment}"
            )
        names.add(tensor.name)
        tensors.append(tensor)
    return tuple(tensors)


def _read_tensor_info(cur: _Cursor) -> TensorInfo:
    name = cur.name("tensor name")
    n_dims = cur.unpack("<I")
    if n_dims > _MAX_DIMS:
        raise cur.corrupt(f"tensor {name!r} has {n_dims} dimensions")
    shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
    tensor = TensorInfo(name, shape, cur.unpack("<I"), cur.unpack("<Q"))
    block = GGML_BLOCK_SIZES.get(tensor.ggml_type)
    if block is not None and shape and shape[0] % block[0]:
        raise cur.corrupt(
            f"tensor {name!r} has rows of {shape[0]} elements, not a multiple of its type's "
            f"block of {block[0]}"
        )
    return tensor


def _check_complete(header: GGUFHeader) -> None:
    """Every tensor's data must lie inside the file (a truncated download fails here), and no
    two tensors may share bytes: writers lay them end to end, and a weight that aliases
    another is a crafted file."""
    needed = header.data_offset
    for tensor in header.tensors:
        end = header.data_offset + tensor.offset + (tensor.nbytes or 0)
        needed = max(needed, end)
    if needed > header.file_size:
        raise ModelLoadError(
            f"{header.path}: file is truncated ({header.file_size:,} bytes, its tensors need "
            f"{needed:,}); re-download or re-convert the model"
        )
    sized = sorted((t for t in header.tensors if t.nbytes), key=lambda t: t.offset)
    for before, after in itertools.pairwise(sized):
        if before.offset + (before.nbytes or 0) > after.offset:
            raise ModelLoadError(
                f"{header.path}: tensors {before.name!r} and {after.name!r} overlap in the "
                "file; it is damaged or crafted — re-download or re-convert the model"
            )
