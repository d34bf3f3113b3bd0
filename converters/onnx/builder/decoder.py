"""The decoder graph as a recipe of parts (one per model, batch 1), named as onnxruntime-genai
names its graphs:

- inputs ``input_ids`` int64 [1, S], ``attention_mask`` int64 [1, T] (T = cached + S), and
  per layer ``past_key_values.{i}.key`` / ``.value`` float32 [1, kv_heads, P, head_dim];
- outputs ``logits`` float32 [1, 1, vocab] (the last position only) and
  ``present.{i}.key`` / ``.value``.

Each layer: RMSNorm -> q/k/v projection -> ``GroupQueryAttention`` (rotary inside, the KV
cache in past/present: bound to one buffer of the planned context, GQA writes in place) ->
output projection -> residual -> RMSNorm -> gated MLP -> residual; what an architecture adds
(per-head q/k norms, post-norms, another activation) is read from its ``Arch``.
"""

from __future__ import annotations

from typing import Any

from .attention import Shared, attention, qkv, shared_inputs
from .context import BuildContext
from .linear import linear
from .parts import add_rms, embedding, lm_head, mlp, post_norm, rms

__all__ = ["decoder", "graph_values", "layer"]


def decoder(b: BuildContext) -> str:
    """Adds the whole decoder to ``b.graph``; returns the name of the logits."""
    shared = shared_inputs(b)
    embedded = embedding(b)
    x, down = embedded.output, ""
    for i in range(b.shape.layers):
        x, down = layer(b, shared, i, x, down)
    x = b.graph.node("Add", [x, down])[0]  # the last layer's MLP output
    return lm_head(b, x, embedded)


def layer(b: BuildContext, shared: Shared, i: int, x: str, down: str) -> tuple[str, str]:
    """Layer ``i`` over the residual stream ``x``; ``down`` is the previous layer's MLP output,
    joined to the stream by this layer's first norm. Returns (stream, this MLP's output)."""
    p = f"blk.{i}"
    if down:
        h, x = add_rms(b, x, down, f"{p}.attn_norm.weight")
    else:
        h = rms(b, x, f"{p}.attn_norm.weight")
    attn = attention(b, shared, i, qkv(b, h, p))
    o = linear(b, attn, [b.need(f"{p}.attn_output.weight")], f"{p}.attn_output")
    o = post_norm(b, o, f"{p}.post_attention_norm.weight")
    h, x = add_rms(b, x, o, f"{p}.ffn_norm.weight")
    down = post_norm(b, mlp(b, h, p, shared.ffn_halves), f"{p}.post_ffw_norm.weight")
    return x, down


def graph_values(b: BuildContext) -> tuple[list[Any], list[Any]]:
    """The graph's inputs and outputs (ONNX value infos)."""
    from onnx import TensorProto

    make = b.graph.helper.make_tensor_value_info
    s = b.shape
    inputs = [
        make("input_ids", TensorProto.INT64, [1, "sequence_length"]),
        make("attention_mask", TensorProto.INT64, [1, "total_sequence_length"]),
    ]
    outputs = [make("logits", TensorProto.FLOAT, [1, 1, s.vocab])]
    past = [1, s.kv_heads, "past_sequence_length", s.head_dim]
    present = [1, s.kv_heads, "total_sequence_length", s.head_dim]
    for i in range(s.layers):
        for kind in ("key", "value"):
            inputs.append(make(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, past))
            outputs.append(make(f"present.{i}.{kind}", TensorProto.FLOAT, present))
    return inputs, outputs
