"""Attention: the q/k/v projection (biases where the file has them, per-head norms where the
architecture has them) and onnxruntime's ``GroupQueryAttention`` with rotary inside and the
KV cache in past/present, over lengths and rotary caches made once per graph."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.files.gguf_file import TensorInfo

from .context import BuildContext
from .linear import linear
from .parts import head_rms

__all__ = ["Shared", "attention", "qkv", "rotary_cache", "shared_inputs"]


@dataclass(frozen=True)
class Shared:
    """Names every layer reads: the lengths GQA takes from the mask, the MLP's split sizes,
    and the rotary caches (the sliding-window layers' own, where they rotate differently)."""

    seqlens_k: str  # int32 [B]: per row, cached + new - 1 (its mask row's sum - 1)
    total_len: str  # int32 scalar: the mask's length (the longest row)
    ffn_halves: str
    cos: str
    sin: str
    cos_swa: str = ""
    sin_swa: str = ""
    half: bool = False  # float16 KV: GQA takes q/k/v and the rotary caches as halves


def shared_inputs(b: BuildContext) -> Shared:
    from onnx import TensorProto

    g = b.graph
    mask_sum = g.node("ReduceSum", ["attention_mask", _const(b, "axis1", [1])], keepdims=0)[0]
    minus_one = g.node("Sub", [mask_sum, g.const("one64", np.array(1, np.int64))])[0]
    seqlens_k = g.node("Cast", [minus_one], to=TensorProto.INT32)[0]
    mask_shape = g.node("Shape", ["attention_mask"])[0]
    total = g.node("Gather", [mask_shape, g.const("idx1", np.array(1, np.int64))], axis=0)[0]
    total32 = g.node("Cast", [total], to=TensorProto.INT32)[0]
    halves = _const(b, "ffn_halves", [b.shape.ffn, b.shape.ffn])
    s = b.shape
    half = b.kv_dtype == "float16"
    dtype = np.float16 if half else np.float32
    cos, sin = rotary_cache(s.rope_dim, s.rope_base, s.rope_scale, b.context)
    names = (g.const("cos_cache", cos.astype(dtype)), g.const("sin_cache", sin.astype(dtype)))
    if s.swa_pattern:  # sliding-window layers rotate with their own base, unscaled
        cos, sin = rotary_cache(s.rope_dim, s.rope_base_swa, 1.0, b.context)
        names += (
            g.const("cos_cache_swa", cos.astype(dtype)),
            g.const("sin_cache_swa", sin.astype(dtype)),
        )
    return Shared(seqlens_k, total32, halves, *names, half=half)


def rotary_cache(
    dim: int, base: float, scale: float, context: int
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [context, dim / 2] for GQA's rotary embedding; positions divided by
    ``scale`` (linear rope scaling)."""
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = np.outer(np.arange(context, dtype=np.float64) / scale, inv)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def qkv(b: BuildContext, h: str, p: str) -> list[str]:
    """GQA's query, key and value inputs for layer ``p``: packed in one tensor, or three
    when each head is normalized first."""
    g, s = b.graph, b.shape
    ts = [b.need(f"{p}.{name}.weight") for name in b.arch.qkv]
    packed = _with_biases(b, linear(b, h, ts, f"{p}.attn_qkv"), p, ts)
    if not b.arch.qk_norm:
        return [packed, "", ""]
    rows = [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim]
    q, k, v = g.node("Split", [packed, g.ints("qkv_rows", rows)], n_out=3, axis=-1)
    q = head_rms(b, q, s.heads, f"{p}.attn_q_norm.weight")
    k = head_rms(b, k, s.kv_heads, f"{p}.attn_k_norm.weight")
    return [q, k, v]


def _with_biases(b: BuildContext, y: str, p: str, weights: list[TensorInfo]) -> str:
    """y plus the projections' biases, when the file has any (zeros for those it lacks)."""
    names = [t.name.removesuffix(".weight") + ".bias" for t in weights]
    biases = [b.tensors.info(name) for name in names]
    if all(t is None for t in biases):
        return y
    rows = [t.shape[1] for t in weights]  # checked against the heads by check_gguf_model
    bias = np.concatenate([_bias(b, t, n) for t, n in zip(biases, rows, strict=True)])
    return b.graph.node("Add", [y, b.graph.const(f"{p}.attn_qkv.bias", bias)])[0]


def _bias(b: BuildContext, t: TensorInfo | None, n: int) -> np.ndarray:
    if t is None:
        return np.zeros(n, np.float32)
    values = b.tensors.floats(t).reshape(-1)
    if values.shape != (n,):
        raise ConversionError(f"tensor {t.name} has {values.size} values, expected {n}")
    return values


def attention(b: BuildContext, shared: Shared, i: int, inputs: list[str]) -> str:
    """Layer ``i``'s GroupQueryAttention; its KV cache is past_key_values.{i} -> present.{i}."""
    from onnx import TensorProto

    s, g = b.shape, b.graph
    swa = s.is_swa(i)
    if shared.half:  # the cache's type is GQA's type: q/k/v go in as halves, out as floats
        inputs = [g.node("Cast", [x], to=TensorProto.FLOAT16)[0] if x else "" for x in inputs]
    out = g.name(f"blk.{i}.attn")
    g.node_named(
        "GroupQueryAttention",
        [
            *inputs,
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            shared.seqlens_k,
            shared.total_len,
            shared.cos_swa if swa else shared.cos,
            shared.sin_swa if swa else shared.sin,
        ],
        [out, f"present.{i}.key", f"present.{i}.value"],
        domain="com.microsoft",
        num_heads=s.heads,
        kv_num_heads=s.kv_heads,
        scale=s.attention_scale or 1.0 / math.sqrt(s.head_dim),
        do_rotary=1,
        rotary_interleaved=int(s.rotary_interleaved),
        local_window_size=s.sliding_window if swa else -1,
    )
    return g.node("Cast", [out], to=TensorProto.FLOAT)[0] if shared.half else out


def _const(b: BuildContext, name: str, values: list[int]) -> str:
    return b.graph.const(name, np.array(values, np.int64))
