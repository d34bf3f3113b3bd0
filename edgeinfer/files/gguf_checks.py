"""A GGUF model's hyperparameters, vocabulary and tensor table, checked against each other
before llama.cpp or the native ONNX builder sees the file.

``read_gguf_header`` checks that the header parses and the tensors lie inside the file. What
it does not see is whether the parts agree: a head count that does not divide, a tensor whose
shape disagrees with the metadata, a vocabulary array of the wrong element type. llama.cpp
answers some of these by aborting the process (``GGML_ASSERT`` in ggml, an array read as
``int *`` past its end), the builder with raw ``ZeroDivisionError``/``IndexError``. Every such
rule lives here, in :func:`check_gguf_model`, called by the loader before llama.cpp opens a
file and by the native builder before it reads one; a failure names the key or tensor.

Rules that hold for every architecture llama.cpp reads the same way (heads, head sizes,
rotary dimensions, experts, the vocabulary arrays, the embedding's rows) are checked for
every file; the full per-layer tensor shapes for the architectures the native builder knows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import EdgeInferError, ModelLoadError
from .gguf_file import ArrayInfo, GGUFHeader, StringInfo

__all__ = ["ModelDims", "check_gguf_model"]

_STRING, _INT32, _FLOAT32 = 8, 5, 6  # GGUF value types
_INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
_MAX_INT = 1 << 24  # far beyond any real dimension, so products stay sane
# llama.cpp asserts these bounds (an abort): LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS (llama-hparams.h)
_MAX_LAYERS = 512
_MAX_EXPERTS = 1024
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # others: an assert in llama.cpp
# per-architecture integers: suffix -> smallest allowed value (when present)
_INTS = {
    "context_length": 1,
    "feed_forward_length": 1,
    "rope.dimension_count": 0,
    "expert_count": 0,
    "expert_used_count": 0,
    "expert_group_count": 0,
    "expert_group_used_count": 0,
    "nextn_predict_layers": 0,
    "attention.sliding_window": 0,
    "attention.sliding_window_pattern": 0,
}
# per-architecture floats that must be finite and positive when present
_FLOATS = (
    "attention.layer_norm_rms_epsilon",
    "attention.layer_norm_epsilon",
    "rope.freq_base",
    "rope.freq_base_swa",
    "rope.scaling.factor",
)
# the native builder's architectures: keys they need, extra per-layer tensors
_REQUIRED = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
_KNOWN_ARCHITECTURES = ("llama", "qwen2", "gemma3")


@dataclass(frozen=True)
class ModelDims:
    """The dimensions every tensor shape is derived from (GGUF order: innermost first)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    key_dim: int
    value_dim: int
    ffn: int
    vocab: int | None


class _Checker:
    def __init__(self, header: GGUFHeader, error: type[EdgeInferError]) -> None:
        self.header, self.error = header, error
        self.arch = header.architecture
        self.meta = header.metadata
        self.complete = False

    def fail(self, key: str, why: str) -> NoReturn:
        raise self.error(
            f"{self.header.path.name}: {key} {why}; the file is damaged or crafted — "
            "re-download or re-convert the model"
        )

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def integer(self, suffix: str, low: int, default: int | None = None) -> int | None:
        key = self.key(suffix)
        value = self.meta.get(key, default)
        if value is None:
            return None
        if type(value) is not int or not low <= value <= _MAX_INT:
            self.fail(f"{key}={_shown(value)}", f"must be an integer from {low} to {_MAX_INT:,}")
        return value

    def number(self, suffix: str) -> None:
        key = self.key(suffix)
        value = self.meta.get(key)
        if value is None:
            return
        ok = type(value) in (int, float) and math.isfinite(value) and value > 0
        if not ok:
            self.fail(f"{key}={_shown(value)}", "must be a finite positive number")


def check_gguf_model(
    header: GGUFHeader, *, error: type[EdgeInferError] = ModelLoadError, complete: bool = False
) -> ModelDims | None:
    """Check that ``header``'s metadata, vocabulary and tensor shapes agree; raise ``error``
    naming the key or tensor that does not. Returns the dimensions when the architecture's
    attention is described by heads (None for other architectures).

    ``complete`` (the builder's reading) also requires what the builder reads: the
    architecture's dimensions and a non-empty vocabulary. llama.cpp refuses files that lack
    them by itself, with an error, so the loader leaves that to it."""
    c = _Checker(header, error)
    c.complete = complete
    for suffix, low in _INTS.items():
        c.integer(suffix, low)
    for suffix in _FLOATS:
        c.number(suffix)
    _check_layers_and_experts(c)
    vocab = _check_vocabulary(c)
    dims = _dims(c, vocab)
    _check_embedding(c, dims, vocab)
    if dims is not None and c.arch in _KNOWN_ARCHITECTURES:
        _check_layer_shapes(c, dims)
    return dims


def _check_layers_and_experts(c: _Checker) -> None:
    """Bounds llama.cpp asserts while reading the hyperparameters (an abort, not an error)."""
    layers = c.integer("block_count", 1)
    if layers is not None and layers > _MAX_LAYERS:
        c.fail(f"{c.key('block_count')}={layers}", f"is more than {_MAX_LAYERS} layers")
    nextn = c.integer("nextn_predict_layers", 0, 0) or 0
    if layers is not None and nextn > layers:
        c.fail(f"{c.key('nextn_predict_layers')}={nextn}", f"is more than {layers} layers")
    count = c.integer("expert_count", 0, 0) or 0
    used = c.integer("expert_used_count", 0, 0) or 0
    groups = c.integer("expert_group_count", 0, 0) or 0
    groups_used = c.integer("expert_group_used_count", 0, 0) or 0
    if count > _MAX_EXPERTS:
        c.fail(f"{c.key('expert_count')}={count}", f"is more than {_MAX_EXPERTS} experts")
    if used > count or (count > 0) != (used > 0):
        c.fail(
            f"{c.key('expert_used_count')}={used}",
            f"does not fit {c.key('expert_count')}={count} (0 < used <= count, or both 0)",
        )
    grouped = groups <= 1 or (count % groups == 0 and 0 < groups_used < groups)
    if (count == 0 and groups) or (count and groups >= count) or not grouped:
        c.fail(
            f"{c.key('expert_group_count')}={groups}",
            f"does not fit {count} experts and {groups_used} groups used",
        )
    scaling = c.meta.get(c.key("rope.scaling.type"))
    if scaling is not None and scaling not in _ROPE_SCALING_TYPES:
        c.fail(
            f"{c.key('rope.scaling.type')}={_shown(scaling)}",
            f"must be one of {', '.join(_ROPE_SCALING_TYPES)}",
        )


def _dims(c: _Checker, vocab: int | None) -> ModelDims | None:
    """Heads and head sizes, checked against each other as llama.cpp derives them."""
    known = c.arch in _KNOWN_ARCHITECTURES
    for suffix in _REQUIRED if known and c.complete else ():
        if c.meta.get(c.key(suffix)) is None:
            c.fail(c.key(suffix), f"is missing (a {c.arch} model needs it)")
    hidden = c.integer("embedding_length", 1)
    layers = c.integer("block_count", 1)
    heads = c.integer("attention.head_count", 1 if known else 0)
    if not heads:  # a model without attention heads (recurrent): nothing derives from them
        if c.integer("attention.head_count_kv", 0):
            c.fail(c.key("attention.head_count_kv"), "is set but attention.head_count is 0")
        return None
    kv_heads = c.integer("attention.head_count_kv", 1, heads) or heads
    if heads % kv_heads:
        c.fail(
            f"{c.key('attention.head_count')}={heads}",
            f"is not a multiple of {c.key('attention.head_count_kv')}={kv_heads}",
        )
    key_dim = _head_size(c, "attention.key_length", hidden, heads)
    value_dim = _head_size(c, "attention.value_length", hidden, heads)
    rope = c.integer("rope.dimension_count", 0)
    if rope is not None and (rope % 2 or rope > key_dim or (known and rope == 0)):
        c.fail(
            f"{c.key('rope.dimension_count')}={rope}",
            f"must be an even number from 2 to the head size ({key_dim})",
        )
    ffn = c.integer("feed_forward_length", 1) or 0
    return ModelDims(hidden or 0, layers or 0, heads, kv_heads, key_dim, value_dim, ffn, vocab)


def _head_size(c: _Checker, suffix: str, hidden: int | None, heads: int) -> int:
    size = c.integer(suffix, 1)
    if size is not None:
        return size
    if hidden is None:
        c.fail(c.key("embedding_length"), "is missing")
    if hidden % heads:
        c.fail(
            f"{c.key('embedding_length')}={hidden}",
            f"is not a multiple of {c.key('attention.head_count')}={heads} (and "
            f"{c.key(suffix)} is not given)",
        )
    return hidden // heads


def _check_vocabulary(c: _Checker) -> int | None:
    """The vocabulary arrays llama.cpp reads through raw pointers: element type and length
    must be exact, or it reads past their end. Returns the token count."""
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        if key in c.meta and not isinstance(c.meta[key], str):
            c.fail(f"{key}={_shown(c.meta[key])}", "must be a string")
    tokens = c.meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    n = _array(c, "tokenizer.ggml.tokens", _STRING)
    if n == 0 and c.complete:
        c.fail("tokenizer.ggml.tokens", "is empty")
    if isinstance(tokens, list) and any(not isinstance(t, str) for t in tokens):
        c.fail("tokenizer.ggml.tokens", "holds a token longer than 1 MB")
    facts = c.header.token_facts
    if facts is not None and facts.duplicate is not None:
        first, again = facts.duplicate
        c.fail(f"tokenizer.ggml.tokens[{again}]", f"repeats token {first} (each must be unique)")
    for key, element in (
        ("tokenizer.ggml.token_type", _INT32),
        ("tokenizer.ggml.scores", _FLOAT32),
    ):
        if key in c.meta and _array(c, key, element) != n:
            c.fail(key, f"must have one entry per token ({n:,})")
    if "tokenizer.ggml.merges" in c.meta:
        _array(c, "tokenizer.ggml.merges", _STRING)
        _check_merges(c, c.meta["tokenizer.ggml.merges"])
    return n


def _array(c: _Checker, key: str, element: int) -> int:
    """Length of the array ``key``, which must hold elements of GGUF type ``element``."""
    value = c.meta[key]
    got = c.header.array_types.get(key)
    if not isinstance(value, (list, ArrayInfo)) or (got is not None and got != element):
        names = {_STRING: "strings", _INT32: "int32", _FLOAT32: "float32"}
        kind = f"an array of type {got}" if got is not None else _shown(value)
        c.fail(f"{key}={kind}", f"must be an array of {names[element]}")
    return value.length if isinstance(value, ArrayInfo) else len(value)


def _check_merges(c: _Checker, merges: Any) -> None:
    """Each merge is two pieces joined by a space (checked when the array was read whole)."""
    if not isinstance(merges, list):
        return
    for i, merge in enumerate(merges):
        if not isinstance(merge, str) or " " not in merge[1:-1]:
            c.fail(f"tokenizer.ggml.merges[{i}]={_shown(merge)}", "is not two pieces 'a b'")


def _check_embedding(c: _Checker, dims: ModelDims | None, vocab: int | None) -> None:
    """The embedding (and a separate output projection) has one row per token."""
    tensors = {t.name: t for t in c.header.tensors}
    for name in ("token_embd.weight", "output.weight"):
        t = tensors.get(name)
        if t is None:
            continue
        if len(t.shape) != 2:
            c.fail(f"tensor {name} of shape {list(t.shape)}", "must have 2 dimensions")
        if dims is not None and dims.hidden and t.shape[0] != dims.hidden:
            c.fail(
                f"tensor {name} of shape {list(t.shape)}",
                f"disagrees with {c.key('embedding_length')}={dims.hidden}",
            )
        if vocab is not None and t.shape[1] != vocab:
            c.fail(
                f"tensor {name} of shape {list(t.shape)}",
                f"has {t.shape[1]:,} rows but tokenizer.ggml.tokens has {vocab:,} tokens",
            )


def _layer_shapes(d: ModelDims, arch: str) -> dict[str, tuple[int, ...]]:
    """Expected shapes of one layer's tensors (GGUF order: [in, out])."""
    q, k, v = d.heads * d.key_dim, d.kv_heads * d.key_dim, d.kv_heads * d.value_dim
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (d.hidden,),
        "attn_q.weight": (d.hidden, q),
        "attn_k.weight": (d.hidden, k),
        "attn_v.weight": (d.hidden, v),
        "attn_output.weight": (d.heads * d.value_dim, d.hidden),
        "ffn_norm.weight": (d.hidden,),
        "ffn_gate.weight": (d.hidden, d.ffn),
        "ffn_up.weight": (d.hidden, d.ffn),
        "ffn_down.weight": (d.ffn, d.hidden),
        "attn_q.bias": (q,),
        "attn_k.bias": (k,),
        "attn_v.bias": (v,),
    }
    if arch == "gemma3":
        shapes |= {
            "attn_q_norm.weight": (d.key_dim,),
            "attn_k_norm.weight": (d.key_dim,),
            "post_attention_norm.weight": (d.hidden,),
            "post_ffw_norm.weight": (d.hidden,),
        }
    return shapes


def _check_layer_shapes(c: _Checker, dims: ModelDims) -> None:
    """Every tensor the builder reads must have the shape the metadata implies."""
    expected = {"output_norm.weight": (dims.hidden,)}
    per_layer = _layer_shapes(dims, c.arch)
    for t in c.header.tensors:
        want = expected.get(t.name)
        parts = t.name.split(".", 2)
        if want is None and len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            want = per_layer.get(parts[2])
        if want is not None and tuple(t.shape) != want:
            c.fail(
                f"tensor {t.name} of shape {list(t.shape)}",
                f"disagrees with the metadata, which implies {list(want)}",
            )


def _shown(value: Any) -> str:
    if isinstance(value, (list, ArrayInfo)):
        return "an array"
    if isinstance(value, StringInfo):
        return f"a string of {value.length:,} bytes"
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."
