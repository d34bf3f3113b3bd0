"""A float source from a quantized GGUF: every tensor dequantized to F32, metadata kept.

The lossy ONNX route (``--quant int4``) re-rounds float weights; the default model ships only
as a Q4_1 GGUF, so its float source is that file dequantized. That source is itself Q4_1's
values (each block ``d * q + m``) in float32, not the original checkpoint: a quantizer run on
it is measured against dequantized Q4_1, and says nothing about the original weights.

The file is the source's bytes up to its tensor table (magic, version, counts, every metadata
key as written; ``general.file_type`` set to all-F32 when it is there), then a new table with
every tensor F32 at aligned offsets, then the tensors, one at a time (peak memory is the
largest tensor). The values are those ``gguf_blocks`` dequantizes, which the native ONNX
graph computes too. ``cached_float_gguf`` keeps one under ``$EDGEINFER_HOME/derived``, keyed
by the source's sha256 and this code's.
"""

from __future__ import annotations

import hashlib
import math
import struct
from pathlib import Path
from typing import IO

from edgeinfer.errors import ConversionError
from edgeinfer.files.gguf_file import GGUFHeader, TensorInfo, read_gguf_header

from ..atomic import atomic_output_file, ensure_free_space
from .checkpoint import file_sha256

__all__ = ["cached_float_gguf", "float_key", "write_float_gguf"]

F32 = 0
_ALL_F32 = 0  # llama_ftype LLAMA_FTYPE_ALL_F32
_UINT32 = 4  # GGUF metadata value type
_FILE_TYPE = b"general.file_type"


def write_float_gguf(src: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``out``: the GGUF ``src`` with every tensor dequantized to F32."""
    from ..onnx.builder.tensors import GGUFTensors  # the builder's dequantizer

    src, out = Path(src), Path(out)
    header = read_gguf_header(src)
    alignment = int(header.metadata.get("general.alignment", 32))
    prefix = _prefix(header)
    offsets, total = _f32_layout(header.tensors, alignment)
    ensure_free_space(out, total + len(prefix) + 1024 * len(header.tensors))
    tensors = GGUFTensors(header, lambda: None)
    with atomic_output_file(out, overwrite=overwrite) as partial, partial.open("wb") as fh:
        fh.write(prefix)
        for t, offset in zip(header.tensors, offsets, strict=True):
            fh.write(_tensor_entry(t.name, t.shape, F32, offset))
        _pad(fh, alignment)
        start = fh.tell()
        for t, offset in zip(header.tensors, offsets, strict=True):
            fh.seek(start + offset)
            fh.write(tensors.floats(t).astype("<f4", copy=False).tobytes())
        fh.truncate(start + total)
    return out


def float_key(src: str | Path) -> str:
    """The cache key of ``src``'s float GGUF: its sha256 and this converter's code's."""
    code = hashlib.sha256()
    for module in (Path(__file__), Path(__file__).parent.parent / "onnx/builder/gguf_blocks.py"):
        code.update(module.read_bytes())
    return f"{file_sha256([Path(src)])[:16]}-float-{code.hexdigest()[:8]}"


def cached_float_gguf(src: str | Path, home: str | Path | None = None) -> Path:
    """``src`` as an F32 GGUF under ``home/derived`` (``$EDGEINFER_HOME`` by default),
    written once and reused while the source and this code are the same."""
    if home is None:
        from edgeinfer.files.catalog import edgeinfer_home

        home = edgeinfer_home()
    src = Path(src)
    out = Path(home) / "derived" / float_key(src) / f"{src.stem}.f32.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_float_gguf(src, out)
    return out


def _prefix(header: GGUFHeader) -> bytes:
    """The source's bytes before its tensor table, ``general.file_type`` set to all-F32."""
    table = b"".join(_tensor_entry(t.name, t.shape, t.ggml_type, t.offset) for t in header.tensors)
    with open(header.path, "rb") as fh:
        head = fh.read(header.data_offset)
    at = head.rfind(table)
    alignment = int(header.metadata.get("general.alignment", 32))
    if at < 0 or len(head) - at - len(table) >= alignment:  # only padding may follow it
        raise ConversionError(f"{header.path.name}: its tensor table was not found where expected")
    prefix = bytearray(head[:at])
    key = struct.pack("<Q", len(_FILE_TYPE)) + _FILE_TYPE + struct.pack("<I", _UINT32)
    found = prefix.find(key)
    if found >= 0:
        value = found + len(key)
        prefix[value : value + 4] = struct.pack("<I", _ALL_F32)
    return bytes(prefix)


def _tensor_entry(name: str, shape: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    raw = name.encode("utf-8")
    dims = b"".join(struct.pack("<Q", d) for d in shape)
    return (
        struct.pack("<Q", len(raw))
        + raw
        + struct.pack("<I", len(shape))
        + dims
        + struct.pack("<IQ", ggml_type, offset)
    )


def _f32_layout(tensors: tuple[TensorInfo, ...], alignment: int) -> tuple[list[int], int]:
    """Each tensor's offset in the F32 data section, and the section's size."""
    offsets, end = [], 0
    for t in tensors:
        end = -(-end // alignment) * alignment
        offsets.append(end)
        end += 4 * math.prod(t.shape)
    return offsets, end


def _pad(fh: IO[bytes], alignment: int) -> None:
    fh.write(b"\0" * (-fh.tell() % alignment))
