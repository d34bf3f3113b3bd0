"""The decoder graph as a recipe of parts (one per model), named as onnxruntime-genai names
its graphs:

- inputs ``input_ids`` int64 [B, S], ``attention_mask`` int64 [B, T], and per layer
  ``past_key_values.{i}.key`` / ``.value`` float32 (or float16, the build's ``kv_dtype``)
  [B, kv_heads, P, head_dim];
- input ``num_logits_to_keep`` int64 [1]: how many of each row's last positions get logits;
- outputs ``logits`` float32 [B, n, vocab] (each row's last n positions) and
  ``present.{i}.key`` / ``.value``.

B ("batch_size") is the number of sequences in one run, each a row of its own cache. Row b's
length is the sum of its mask row (cached + S): GroupQueryAttention reads it as ``seqlens_k``
and places row b's new entries and rotary positions from it, so rows of different lengths
share a run when their mask rows are padded with zeros to the longest (T). All rows take the
same S new tokens (a batch step is S = 1), so the last position is the last row of each.

Each layer: RMSNorm -> q/k/v projection -> ``GroupQueryAttention`` (rotary inside, the KV
cache in past/present: bound to one buffer of the planned context, GQA writes in place) ->
output projection -> residual -> RMSNorm -> gated MLP -> residual; what an architecture adds
(per-head q/k norms, post-norms, another activation) is read from its ``Arch``.
"""

from __future__ import annotations

from typing import Any

from edgeinfer.runtimes.onnx_checks import LOGITS_TO_KEEP

from .attention import Shared, attention, qkv, shared_inputs
from .context import BuildContext
from .linear import linear
from .parts import add_rms, embedding, lm_head, mlp, post_norm, rms

__all__ = ["BATCH", "decoder", "graph_values", "layer"]

BATCH = "batch_size"  # the symbolic first axis of the inputs, the logits and the cache


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
        make("input_ids", TensorProto.INT64, [BATCH, "sequence_length"]),
        make("attention_mask", TensorProto.INT64, [BATCH, "total_sequence_length"]),
        make(LOGITS_TO_KEEP, TensorProto.INT64, [1]),
    ]
    outputs = [make("logits", TensorProto.FLOAT, [BATCH, "logits_length", s.vocab])]
    kv = TensorProto.FLOAT16 if b.kv_dtype == "float16" else TensorProto.FLOAT
    past = [BATCH, s.kv_heads, "past_sequence_length", s.head_dim]
    present = [BATCH, s.kv_heads, "total_sequence_length", s.head_dim]
    for i in range(s.layers):
        for kind in ("key", "value"):
            inputs.append(make(f"past_key_values.{i}.{kind}", kv, past))
            outputs.append(make(f"present.{i}.{kind}", kv, present))
    return inputs, outputs
