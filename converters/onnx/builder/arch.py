"""What differs between the architectures the builder knows, as data, and the model's
dimensions read from a GGUF header.

llama.cpp's gguf-py keeps per-architecture tensor names in tables and mlx-lm keeps a small
``ModelArgs`` per family; here one frozen ``Arch`` per GGUF ``general.architecture`` says
what a layer does beyond a plain Llama decoder, and the graph functions read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from edgeinfer.errors import ConversionError
from edgeinfer.files.gguf_checks import check_gguf_model
from edgeinfer.files.gguf_file import GGUFHeader

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "Arch",
    "Shape",
    "architecture",
    "gguf_shape",
]


@dataclass(frozen=True)
class Arch:
    """One architecture's differences from a plain Llama decoder (RMSNorm, q/k/v, rotary by
    halves, SiLU-gated MLP). What a file can show by its tensors needs no entry: q/k/v biases
    are added when the file has them, and a missing ``output.weight`` means a tied head."""

    # llama.cpp stores Llama's Q/K rows for rotation of adjacent pairs (its converter permutes
    # them); the others keep them as trained, rotated by halves (NeoX style)
    rotary_interleaved: bool = False
    # the GGUF tensors (names after ``blk.{i}.``, before ``.weight``) whose rows are stacked
    # into the query/key/value projection and the MLP's gate/up projection
    qkv: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")
    gate_up: tuple[str, ...] = ("ffn_gate", "ffn_up")
    qk_norm: bool = False  # RMSNorm of each query and key head before attention
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual
    embedding_scale: bool = False  # the embedding times sqrt(hidden), in float32 as llama.cpp
    activation: str = "silu"  # the MLP gate's, a key of parts.ACTIVATIONS
    sliding_window: bool = False  # reads the window, its layer pattern and its rotary base
    rope_scaling: bool = False  # reads linear rope scaling (positions divided by the factor)
    # reads ``edgeinfer.attention_scale`` (Gemma's query_pre_attn_scalar, as the writer keeps
    # it); block counts listed in ``hidden_scaled_depths`` default to 1/sqrt(hidden / heads)
    attention_scale: bool = False
    hidden_scaled_depths: frozenset[int] = frozenset()


ARCHITECTURES: dict[str, Arch] = {
    # Llama, SmolLM, Mistral without sliding window
    "llama": Arch(rotary_interleaved=True),
    # biases on q/k/v and an untied output projection, both read from the file
    "qwen2": Arch(),
    "gemma3": Arch(
        qk_norm=True,
        post_norms=True,
        embedding_scale=True,
        activation="gelu_tanh",  # llama.cpp's ggml_gelu
        sliding_window=True,
        rope_scaling=True,
        attention_scale=True,
        hidden_scaled_depths=frozenset({62}),  # llama.cpp: 27B scales by hidden / heads
    ),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_base: float
    rope_dim: int
    context: int
    rotary_interleaved: bool
    rope_scale: float = 1.0  # linear scaling of positions (global layers of Gemma 3 4B+)
    # sliding-window layers (window, layers in a repeating group, their rope base)
    sliding_window: int = 0
    swa_pattern: int = 0
    rope_base_swa: float = 10000.0
    attention_scale: float = 0.0  # 0: 1 / sqrt(head_dim)

    def is_swa(self, layer: int) -> bool:
        """llama.cpp's pattern: in each group of ``swa_pattern`` layers, the last is global."""
        return self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1


def architecture(header: GGUFHeader) -> Arch:
    """The file's entry in ``ARCHITECTURES``; ConversionError naming the supported ones."""
    arch = ARCHITECTURES.get(header.architecture)
    if arch is None:
        raise ConversionError(
            f"{header.path.name}: architecture {header.architecture!r} is not supported by the "
            f"native ONNX builder (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def gguf_shape(header: GGUFHeader) -> Shape:
    """The model's dimensions; ConversionError for an architecture the builder does not know."""
    arch = architecture(header)
    check_gguf_model(header, error=ConversionError, complete=True)  # heads divide, shapes agree
    v = header.arch_value
    hidden = int(v("embedding_length"))
    heads = int(v("attention.head_count"))
    head_dim = int(v("attention.key_length", hidden // heads))
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConversionError(f"{header.path.name}: tensor token_embd.weight is missing")
    layers = int(v("block_count"))
    extra = _optional_hparams(header, arch, layers, hidden // heads, head_dim)
    return Shape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=int(v("attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn=int(v("feed_forward_length")),
        vocab=int(embd.shape[1]),
        eps=float(v("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(v("rope.freq_base", 10000.0)),
        rope_dim=int(v("rope.dimension_count", head_dim)),
        context=int(v("context_length", 2048)),
        rotary_interleaved=bool(
            header.metadata.get("edgeinfer.rotary_interleaved", arch.rotary_interleaved)
        ),
        **extra,
    )


def _optional_hparams(
    header: GGUFHeader, arch: Arch, layers: int, hidden_per_head: int, head_dim: int
) -> dict[str, Any]:
    """The Shape fields only some architectures read (the rest keep Shape's defaults)."""
    v = header.arch_value
    extra: dict[str, Any] = {}
    if arch.rope_scaling:
        factor = v("rope.scaling.factor")
        scaled = v("rope.scaling.type") == "linear" and isinstance(factor, (int, float))
        extra["rope_scale"] = float(factor) if scaled and factor else 1.0
    if arch.sliding_window:
        extra["sliding_window"] = int(v("attention.sliding_window", 0))
        extra["swa_pattern"] = int(v("attention.sliding_window_pattern", 6))
        extra["rope_base_swa"] = float(v("rope.freq_base_swa", 10000.0))
    if arch.attention_scale:
        per_head = hidden_per_head if layers in arch.hidden_scaled_depths else head_dim
        default = 1.0 / math.sqrt(per_head)
        extra["attention_scale"] = _positive(header, "edgeinfer.attention_scale", default)
    return extra


def _positive(header: GGUFHeader, key: str, default: float) -> float:
    value = header.metadata.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ConversionError(f"{header.path.name}: {key}={value!r:.60} must be a positive number")
    return float(value)
