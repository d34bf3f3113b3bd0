"""The model's parts as graph functions: embedding, norms, the MLP and the output head. Each
takes the frozen ``BuildContext``, adds its nodes and returns the name of its output."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgeinfer.gguf_file import TensorInfo
from edgeinfer.runtimes.onnx_checks import LOGITS_TO_KEEP

from .context import BuildContext
from .gguf_blocks import Q4_0, Q8_0, NBitsWeight, transcode
from .graph import Graph
from .linear import linear, matmul_nbits, requantize

__all__ = [
    "ACTIVATIONS",
    "Embedding",
    "add_rms",
    "embedding",
    "head_rms",
    "lm_head",
    "mlp",
    "post_norm",
    "rms",
]


def rms(b: BuildContext, x: str, name: str) -> str:
    """RMSNorm(x) with the weight tensor ``name``."""
    w = b.graph.const(name, b.floats(name))
    return b.graph.node(
        "SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=b.shape.eps, stash_type=1
    )[0]


def add_rms(b: BuildContext, residual: str, y: str, name: str) -> tuple[str, str]:
    """(RMSNorm(residual + y), residual + y) in one node."""
    w = b.graph.const(name, b.floats(name))
    normed, _, _, total = b.graph.node(
        "SkipSimplifiedLayerNormalization",
        [residual, y, w],
        n_out=4,
        domain="com.microsoft",
        epsilon=b.shape.eps,
    )
    return normed, total


def head_rms(b: BuildContext, y: str, heads: int, name: str) -> str:
    """RMSNorm of each head's vector ([B, S, heads * head_dim] -> per head and back)."""
    g, head_dim = b.graph, b.shape.head_dim
    per_head = g.node("Reshape", [y, g.ints("heads", [0, 0, heads, head_dim])])[0]
    normed = rms(b, per_head, name)
    return g.node("Reshape", [normed, g.ints("flat", [0, 0, heads * head_dim])])[0]


def post_norm(b: BuildContext, y: str, name: str) -> str:
    """A block's output normalized before the residual, where the architecture does so."""
    return rms(b, y, name) if b.arch.post_norms else y


@dataclass(frozen=True)
class Embedding:
    """The embedding's output and what a tied output head shares with it: the blocks (the
    packed weights are the initializer ``token_embd.qweight``) or the float table."""

    output: str
    blocks: NBitsWeight | None
    table: str | None


def embedding(b: BuildContext) -> Embedding:
    """Q8_0/Q4_0 blocks gathered as they are (GatherBlockQuantized, exact), re-rounded blocks
    likewise; other types as a float table."""
    g, t = b.graph, b.need("token_embd.weight")
    blocks = _embedding_blocks(b, t)
    if blocks is None:
        table = g.const("token_embd.weight", b.tensors.floats(t))
        x = g.node("Gather", [table, "input_ids"], axis=0)[0]
    else:
        table = None
        packed = g.const("token_embd.qweight", blocks.packed)
        rows = g.node("Reshape", [packed, g.const("embd_rows", _int64([b.shape.vocab, -1]))])
        x = g.node(
            "GatherBlockQuantized",
            [rows[0], "input_ids", g.const("token_embd.scales", blocks.scales)],
            domain="com.microsoft",
            gather_axis=0,
            quantize_axis=1,
            block_size=blocks.block_size,
            bits=blocks.bits,
        )[0]
    if b.arch.embedding_scale:
        scale = g.const("embd_scale", np.array(math.sqrt(b.shape.hidden), np.float32))
        x = g.node("Mul", [x, scale])[0]
    return Embedding(x, blocks, table)


def _embedding_blocks(b: BuildContext, t: TensorInfo) -> NBitsWeight | None:
    bits = b.quant.bits_for(t.name)
    if bits is not None:
        return requantize(b.tensors.floats(t), int(bits))
    if b.quant.mode == "keep" and t.ggml_type in (Q8_0, Q4_0):
        return transcode(t.ggml_type, b.tensors.raw(t), b.shape.vocab, b.shape.hidden)
    return None


def _silu(g: Graph, x: str) -> str:
    return g.node("Mul", [x, g.node("Sigmoid", [x])[0]])[0]


def _gelu_tanh(g: Graph, x: str) -> str:
    return g.node("Gelu", [x], approximate="tanh")[0]


ACTIVATIONS: dict[str, Callable[[Graph, str], str]] = {"silu": _silu, "gelu_tanh": _gelu_tanh}


def mlp(b: BuildContext, h: str, p: str, halves: str) -> str:
    """down(act(gate(h)) * up(h)); gate and up in one projection, split by ``halves``."""
    g = b.graph
    ts = [b.need(f"{p}.{name}.weight") for name in b.arch.gate_up]
    gate, up = g.node("Split", [linear(b, h, ts, f"{p}.ffn_gate_up"), halves], n_out=2, axis=-1)
    act = ACTIVATIONS[b.arch.activation](g, gate)
    return linear(b, g.node("Mul", [act, up])[0], [b.need(f"{p}.ffn_down.weight")], f"{p}.ffn_down")


def lm_head(b: BuildContext, x: str, embedded: Embedding) -> str:
    """Each row's last ``num_logits_to_keep`` positions (every row has the same length S; 1
    for a prefill or a step, k + 1 for a speculative verify pass), the final norm, then the
    vocabulary projection: its own weights, or the embedding's (tied)."""
    g = b.graph
    start = g.node("Neg", [LOGITS_TO_KEEP])[0]
    last = g.node(
        "Slice",
        [
            x,
            start,
            g.const("last_end", _int64([np.iinfo(np.int64).max])),
            g.const("last_axis", _int64([1])),
        ],
    )[0]
    h = rms(b, last, "output_norm.weight")  # [B, n, hidden]
    head = b.tensors.info("output.weight")
    if head is not None:
        return linear(b, h, [head], "output")
    if embedded.blocks is not None:  # tied: the same blocks as the embedding
        w = embedded.blocks
        b.report.count_blocks(w.bits, w.block_size)
        scales = g.const("output.scales", w.scales.reshape(-1))
        return matmul_nbits(b, h, "token_embd.qweight", scales, w, w.n)
    assert embedded.table is not None  # the embedding is blocks or a table
    flat = g.node("Reshape", [h, g.const("flat_shape", _int64([-1, b.shape.hidden]))])
    logits2d = g.node("Gemm", [flat[0], embedded.table], transB=1)[0]  # [B * n, vocab]
    rows = g.node("Shape", [h], end=2)[0]  # [B, n]
    shape = g.node("Concat", [rows, g.const("vocab_dim", _int64([b.shape.vocab]))], axis=0)[0]
    return g.node("Reshape", [logits2d, shape])[0]


def _int64(values: list[int]) -> np.ndarray:
    return np.array(values, np.int64)
