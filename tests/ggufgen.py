"""Write small GGUF files by hand (header + tensor table + data) for reader tests, and whole
tiny models (a consistent Llama with a byte-level BPE vocabulary, no torch needed) whose
every metadata value, array and tensor a test may replace with what a hostile writer puts
there."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f"}
_FORMATS |= {BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
GGML_F32 = 0


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
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


# -- whole models -------------------------------------------------------------------------


@dataclass
class Value:
    """One metadata value: its GGUF type and a Python value (for ARRAY: (element type, items));
    ``raw`` replaces the encoded payload with any bytes."""

    vtype: int
    value: Any = None
    raw: bytes | None = None

    def encode(self) -> bytes:
        payload = self.raw if self.raw is not None else _payload(self.vtype, self.value)
        return struct.pack("<I", self.vtype) + payload


def _payload(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        element, items = value
        body = b"".join(_payload(element, item) for item in items)
        return struct.pack("<IQ", element, len(items)) + body
    return struct.pack(_FORMATS[vtype], value)


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost first
    data: bytes
    ggml_type: int = GGML_F32
    offset: int | None = None  # None: laid after the previous tensor


@dataclass
class Model:
    metadata: dict[str, Value]
    tensors: list[Tensor] = field(default_factory=list)

    def to_bytes(self, alignment: int = 32) -> bytes:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata)))
        for key, value in self.metadata.items():
            out += _string(key) + value.encode()
        data = bytearray()
        for t in self.tensors:
            data += b"\0" * (-len(data) % alignment)
            offset = len(data) if t.offset is None else t.offset
            if t.offset is None:
                data += t.data
            out += _string(t.name) + struct.pack("<I", len(t.shape))
            out += b"".join(struct.pack("<Q", d) for d in t.shape)
            out += struct.pack("<IQ", t.ggml_type, offset)
        out += b"\0" * (-len(out) % alignment)
        return bytes(out + data)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.to_bytes())
        return path


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-character mapping, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "Ġ a", "o n", "Ġ s", "r e"]


def tiny_llama(
    *,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    ffn: int = 128,
    context: int = 256,
    seed: int = 0,
) -> Model:
    """A consistent tiny Llama (f32 random weights, byte-level BPE vocabulary) that llama.cpp
    and the native builder both load."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = byte_level_alphabet() + [m.replace(" ", "") for m in _MERGES] + ["<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]
    vocab, head_dim = len(tokens), hidden // heads
    meta = {
        "general.architecture": Value(STRING, "llama"),
        "general.alignment": Value(U32, 32),
        "llama.context_length": Value(U32, context),
        "llama.embedding_length": Value(U32, hidden),
        "llama.block_count": Value(U32, layers),
        "llama.feed_forward_length": Value(U32, ffn),
        "llama.attention.head_count": Value(U32, heads),
        "llama.attention.head_count_kv": Value(U32, kv_heads),
        "llama.rope.dimension_count": Value(U32, head_dim),
        "llama.rope.freq_base": Value(F32, 10000.0),
        "llama.attention.layer_norm_rms_epsilon": Value(F32, 1e-5),
        "tokenizer.ggml.model": Value(STRING, "gpt2"),
        "tokenizer.ggml.pre": Value(STRING, "default"),
        "tokenizer.ggml.tokens": Value(ARRAY, (STRING, tokens)),
        "tokenizer.ggml.token_type": Value(ARRAY, (I32, types)),
        "tokenizer.ggml.merges": Value(ARRAY, (STRING, list(_MERGES))),
        "tokenizer.ggml.bos_token_id": Value(U32, vocab - 1),
        "tokenizer.ggml.eos_token_id": Value(U32, vocab - 1),
        "tokenizer.ggml.add_bos_token": Value(BOOL, False),
    }

    def weight(name: str, *shape: int) -> Tensor:
        values = rng.standard_normal(tuple(reversed(shape))).astype(np.float32) * 0.5
        if name.endswith("norm.weight"):
            values = np.ones_like(values)
        return Tensor(name, shape, values.tobytes())

    tensors = [weight("token_embd.weight", hidden, vocab)]
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}"
        tensors += [
            weight(f"{p}.attn_norm.weight", hidden),
            weight(f"{p}.attn_q.weight", hidden, q),
            weight(f"{p}.attn_k.weight", hidden, kv),
            weight(f"{p}.attn_v.weight", hidden, kv),
            weight(f"{p}.attn_output.weight", q, hidden),
            weight(f"{p}.ffn_norm.weight", hidden),
            weight(f"{p}.ffn_gate.weight", hidden, ffn),
            weight(f"{p}.ffn_up.weight", hidden, ffn),
            weight(f"{p}.ffn_down.weight", ffn, hidden),
        ]
    tensors.append(weight("output_norm.weight", hidden))
    return Model(meta, tensors)


def reshaped(tensor: Tensor, shape: Sequence[int]) -> Tensor:
    """``tensor`` claiming ``shape``, its data cut or padded to that many f32 values."""
    n = 1
    for d in shape:
        n *= d
    data = (tensor.data * (1 + 4 * n // max(len(tensor.data), 1)))[: 4 * n]
    return Tensor(tensor.name, tuple(shape), data, tensor.ggml_type, tensor.offset)
