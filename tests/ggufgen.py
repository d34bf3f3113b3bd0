"""Write small GGUF files by hand (header + tensor table + data) for reader tests."""

from __future__ import annotations

import struct
from pathlib import Path


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf(path: Path, *, tensors: int = 2, version: int = 3, arrays: int = 0) -> Path:
    """A GGUF file with ``tensors`` f32 tensors of 8x4 and some metadata."""
    kv = [
        (_string("general.architecture"), 8, _string("llama")),
        (_string("llama.context_length"), 4, struct.pack("<I", 2048)),
        (_string("tokenizer.chat_template"), 8, _string("{{ messages[0]['content'] }}")),
        (_string("llama.rope.freq_base"), 6, struct.pack("<f", 10000.0)),
    ]
    big = struct.pack("<IQ", 8, arrays) + b"".join(_string(f"t{i}") for i in range(arrays))
    kv.append((_string("tokenizer.ggml.tokens"), 9, big))
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, tensors, len(kv)))
    for key, vtype, value in kv:
        out += key + struct.pack("<I", vtype) + value
    nbytes = 8 * 4 * 4
    for i in range(tensors):
        out += _string(f"blk.{i}.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 8, 4)
        out += struct.pack("<IQ", 0, i * nbytes)  # type f32, offset
    out += b"\0" * (-len(out) % 32)
    out += b"\x01" * (nbytes * tensors)
    path.write_bytes(bytes(out))
    return path
