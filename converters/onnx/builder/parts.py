"""The model's parts as graph functions: embedding, norms, the MLP and the output head. Each
takes the frozen ``BuildContext``, adds its nodes and returns the name of its output."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgeinfer.files.gguf_file import TensorInfo
from edgeinfer.runtimes.onnx_checks import LOGITS_TO_KEEP

from .context import BuildContext
from .gguf_blocks import FORMS, OFFSET_BLOCK, BlockForm
from .graph import Graph, Region
from .linear import block_form, block_sums, linear, matmul_nbits, weight_bands, write_blocks
from .tensors import float_bands, spans

_GATHERED = frozenset(FORMS)  # block types the embedding keeps as blocks

__all__ = [
    "ACTIVATIONS",
    "Embedding",
    "GatheredBlocks",
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
class GatheredBlocks:
    """The embedding's blocks as a tied output head reads them again: the packed weights are
    the initializer ``token_embd.qweight``; its scales and offsets are read back from here."""

    form: BlockForm
    n: int  # vocabulary rows
    k: int  # hidden
    scales: Region  # [n, k / block_size]
    offset: Region | None  # [n, k / 32, 1]


@dataclass(frozen=True)
class Embedding:
    """The embedding's output and what a tied output head shares with it: the blocks or the
    float table."""

    output: str
    blocks: GatheredBlocks | None
    table: str | None


def embedding(b: BuildContext) -> Embedding:
    """Block types gathered as they are (GatherBlockQuantized, plus a gathered offset per 32
    for the types with a minimum: exact), re-rounded blocks likewise; other types as a float
    table."""
    g, t = b.graph, b.need("token_embd.weight")
    form = _embedding_form(b, t)
    blocks, table = None, None
    if form is None:
        table = _float_table(b, t)
        x = g.node("Gather", [table, "input_ids"], axis=0)[0]
    else:
        blocks, x = _gathered(b, t, form)
    if b.arch.embedding_scale:
        scale = g.const("embd_scale", np.array(math.sqrt(b.shape.hidden), np.float32))
        x = g.node("Mul", [x, scale])[0]
    return Embedding(x, blocks, table)


def _embedding_form(b: BuildContext, t: TensorInfo) -> BlockForm | None:
    if b.quant.bits_for(t.name) is not None:
        return block_form(b, t)
    if b.quant.mode == "keep" and t.ggml_type in _GATHERED:
        return block_form(b, t)
    return None


def _float_table(b: BuildContext, t: TensorInfo) -> str:
    table = b.graph.reserve("token_embd.weight", (b.shape.vocab, b.shape.hidden), np.float32)
    for start, rows in float_bands(b.tensors, t):
        table.write(start * b.shape.hidden, rows)
    table.done()
    return table.name


def _gathered(b: BuildContext, t: TensorInfo, form: BlockForm) -> tuple[GatheredBlocks, str]:
    """The embedding's blocks, gathered by ``input_ids``: (the blocks, the output)."""
    g, n, k = b.graph, b.shape.vocab, b.shape.hidden
    per_row, row_bytes = k // form.block_size, form.block_size * form.bits // 8
    packed = g.reserve("token_embd.qweight", (n, per_row, row_bytes), np.uint8)
    rows = g.node("Reshape", [packed.name, g.const("embd_rows", _int64([n, -1]))])
    scales = g.reserve("token_embd.scales", (n, per_row), np.float32)
    x = g.node(
        "GatherBlockQuantized",
        [rows[0], "input_ids", scales.name],
        domain="com.microsoft",
        gather_axis=0,
        quantize_axis=1,
        block_size=form.block_size,
        bits=form.bits,
    )[0]
    offset = None
    if form.offset:
        offset = g.reserve("token_embd.offset", (n, k // OFFSET_BLOCK, 1), np.float32)
        x = _plus_offsets(g, x, offset.name, k)
    row = 0
    for w in weight_bands(b, t):
        write_blocks(w, row, packed, scales, None)
        if offset is not None and w.offset is not None:
            offset.write(row * (k // OFFSET_BLOCK), w.offset)
        row += w.n
    for region in (packed, scales, offset):
        if region is not None:
            region.done()
    return GatheredBlocks(form, n, k, scales, offset), x


def _plus_offsets(g: Graph, x: str, offset: str, k: int) -> str:
    """x [B, S, k] plus each row's offsets [k / 32], gathered and added to 32 values each."""
    blocks = g.node("Reshape", [x, g.const("embd_blocks", _int64([0, 0, k // OFFSET_BLOCK, -1]))])
    rows = g.node("Gather", [offset, "input_ids"], axis=0)[0]  # [B, S, k / 32, 1]
    summed = g.node("Add", [blocks[0], rows])[0]
    return g.node("Reshape", [summed, g.const("embd_flat", _int64([0, 0, k]))])[0]


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
        return _tied_head(b, h, embedded.blocks)
    assert embedded.table is not None  # the embedding is blocks or a table
    flat = g.node("Reshape", [h, g.const("flat_shape", _int64([-1, b.shape.hidden]))])
    logits2d = g.node("Gemm", [flat[0], embedded.table], transB=1)[0]  # [B * n, vocab]
    rows = g.node("Shape", [h], end=2)[0]  # [B, n]
    shape = g.node("Concat", [rows, g.const("vocab_dim", _int64([b.shape.vocab]))], axis=0)[0]
    return g.node("Reshape", [logits2d, shape])[0]


def _tied_head(b: BuildContext, h: str, w: GatheredBlocks) -> str:
    """h @ W.T with the embedding's blocks: its packed weights shared, its scales (and
    offsets, transposed) copied to the head's own initializers a band at a time."""
    g, per_32 = b.graph, w.k // OFFSET_BLOCK
    b.report.count_blocks(w.form.bits, w.form.block_size)
    scales = g.reserve("output.scales", (w.scales.size,), np.float32)
    scales.copy_from(w.scales)
    y = matmul_nbits(b, h, "token_embd.qweight", scales.name, w.form, w.k, w.n)
    if w.offset is None:
        return y
    sums = block_sums(b, h, w.k)
    offset_t = g.reserve("output.offset_t", (per_32, w.n), np.float32)
    for start, stop in spans(w.n, per_32):
        rows = w.offset.read(start * per_32, (stop - start) * per_32)
        offset_t.write_columns(start, rows.reshape(-1, per_32))
    offset_t.done()
    return g.node("Add", [y, g.node("MatMul", [sums, offset_t.name])[0]])[0]


def _int64(values: list[int]) -> np.ndarray:
    return np.array(values, np.int64)
