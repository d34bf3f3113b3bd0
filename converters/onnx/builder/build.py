"""A native ONNX decoder graph from a GGUF file: onnxruntime's contrib operators, weights
taken from the file as they are, no torch, transformers or optimum.

The graph (one per model, batch 1), named as onnxruntime-genai names its graphs:

- inputs ``input_ids`` int64 [1, S], ``attention_mask`` int64 [1, T] (T = cached + S), and
  per layer ``past_key_values.{i}.key`` / ``.value`` float32 [1, kv_heads, P, head_dim];
- outputs ``logits`` float32 [1, 1, vocab] (the last position only) and
  ``present.{i}.key`` / ``.value``.

Each layer: RMSNorm -> q/k/v projections -> ``GroupQueryAttention`` (rotary inside, the KV
cache in past/present: bound to one buffer of the planned context, GQA writes in place) ->
output projection -> residual -> RMSNorm -> SiLU-gated MLP -> residual. Projections whose GGUF
blocks map exactly onto ``MatMulNBits`` (``gguf_blocks``) keep their blocks, with the offset
term for types with a minimum; float weights use ``MatMul``. llama.cpp's Llama Q/K rows are
stored for rotation of adjacent pairs, so GQA rotates interleaved for them.

This module covers the Llama architecture (Llama, SmolLM, Mistral without sliding window)
and Qwen2 (biases on q/k/v, rotation by halves, an untied output projection).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.gguf_checks import check_gguf_model
from edgeinfer.gguf_file import GGUFHeader, TensorInfo, read_gguf_header

from .gguf_blocks import OFFSET_BLOCK, Q4_0, Q8_0, NBitsWeight, quantize_symmetric, transcode

__all__ = [
    "QUANTS",
    "SUPPORTED_ARCHITECTURES",
    "BuildReport",
    "build_onnx_from_gguf",
    "gguf_shape",
]

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
# llama.cpp stores Llama's Q/K rows for rotation of adjacent pairs (the converter permutes
# them); Qwen2's are stored as trained, rotated by halves (NeoX style)
_INTERLEAVED_ROTARY = frozenset({"llama"})
F32, F16, BF16 = 0, 1, 30
ACCURACY_LEVEL = 4  # MatMulNBits quantizes activations to int8 per block: its fast CPU path
QUANTS = ("keep", "int4", "int8", "fp32")  # keep: the GGUF's own blocks, exactly
_INLINE_BYTES = 1024
_DATA_ALIGN = 64


@dataclass
class BuildReport:
    architecture: str
    layers: int
    nbits: dict[str, int]  # "4-bit/32" -> tensors
    widened: dict[str, str]  # tensor -> why it is stored as floats
    max_context: int
    shape: Shape


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
    # Gemma 3: sliding-window layers (window, layers in a repeating group, their rope base)
    sliding_window: int = 0
    swa_pattern: int = 0
    rope_base_swa: float = 10000.0
    attention_scale: float = 0.0  # 0: 1 / sqrt(head_dim)

    def is_swa(self, layer: int) -> bool:
        """llama.cpp's pattern: in each group of ``swa_pattern`` layers, the last is global."""
        return self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1


def gguf_shape(header: GGUFHeader) -> Shape:
    """The model's dimensions; ConversionError for an architecture the builder does not know."""
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            f"{header.path.name}: architecture {arch!r} is not supported by the native ONNX "
            f"builder (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    check_gguf_model(
        header, error=ConversionError, complete=True
    )  # heads divide, shapes agree, ...
    v = header.arch_value
    hidden = int(v("embedding_length"))
    heads = int(v("attention.head_count"))
    kv_heads = int(v("attention.head_count_kv", heads))
    head_dim = int(v("attention.key_length", hidden // heads))
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConversionError(f"{header.path.name}: tensor token_embd.weight is missing")
    layers = int(v("block_count"))
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        factor = v("rope.scaling.factor")
        scaled = v("rope.scaling.type") == "linear" and isinstance(factor, (int, float))
        # llama.cpp: queries scaled by 1/sqrt(head_dim), except 27B (62 layers): hidden/heads
        per_head = hidden // heads if layers == 62 else head_dim
        extra = {
            "rope_scale": float(factor) if scaled and factor else 1.0,
            "sliding_window": int(v("attention.sliding_window", 0)),
            "swa_pattern": int(v("attention.sliding_window_pattern", 6)),
            "rope_base_swa": float(v("rope.freq_base_swa", 10000.0)),
            "attention_scale": _positive(
                header, "edgeinfer.attention_scale", 1.0 / math.sqrt(per_head)
            ),
        }
    return Shape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=int(v("feed_forward_length")),
        vocab=int(embd.shape[1]),
        eps=float(v("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(v("rope.freq_base", 10000.0)),
        rope_dim=int(v("rope.dimension_count", head_dim)),
        context=int(v("context_length", 2048)),
        rotary_interleaved=bool(
            header.metadata.get("edgeinfer.rotary_interleaved", arch in _INTERLEAVED_ROTARY)
        ),
        **extra,
    )


def _positive(header: GGUFHeader, key: str, default: float) -> float:
    value = header.metadata.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ConversionError(f"{header.path.name}: {key}={value!r:.60} must be a positive number")
    return float(value)


class _Tensors:
    """The GGUF file's tensors, memory-mapped; one at a time as numpy arrays."""

    def __init__(self, header: GGUFHeader, on_read: Callable[[], None]) -> None:
        self.header = header
        self._by_name = {t.name: t for t in header.tensors}
        self.on_read = on_read
        self.seen: set[str] = set()

    def info(self, name: str) -> TensorInfo | None:
        return self._by_name.get(name)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes, read on their own: pages of a memory map would stay in the
        process's resident set, and the build's peak is meant to be one tensor."""
        nbytes = t.nbytes
        if nbytes is None:
            raise ConversionError(f"tensor {t.name}: unknown GGML type {t.ggml_type}")
        with open(self.header.path, "rb") as fh:
            fh.seek(self.header.data_offset + t.offset)
            data = np.frombuffer(fh.read(nbytes), dtype=np.uint8)
        if len(data) != nbytes:
            raise ConversionError(f"{self.header.path.name}: tensor {t.name} is cut short")
        if t.name not in self.seen:
            self.seen.add(t.name)
            self.on_read()
        return data

    def floats(self, t: TensorInfo) -> np.ndarray:
        """The tensor as float32 with numpy dims (outer first), dequantized when needed."""
        dims = tuple(reversed(t.shape))
        raw = self.raw(t)
        if t.ggml_type == F32:
            return raw.view(np.float32).reshape(dims).astype(np.float32)
        if t.ggml_type == F16:
            return raw.view(np.float16).reshape(dims).astype(np.float32)
        if t.ggml_type == BF16:
            bits = raw.view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(dims)
        if len(dims) == 2:
            weight = transcode(t.ggml_type, raw, dims[0], dims[1])
            if weight is not None:
                return weight.dequantize()
        try:
            from gguf.quants import dequantize
        except ImportError as exc:
            raise ConversionError(
                f"tensor {t.name} is GGML type {t.ggml_type}; widening it needs the gguf "
                "package: pip install 'edgeinfer[convert]'"
            ) from exc
        return np.asarray(dequantize(raw.reshape(dims[0], -1), t.ggml_type), np.float32).reshape(
            dims
        )


class _Graph:
    """Nodes and initializers as they are added; names made unique."""

    def __init__(self, data: Any, data_name: str) -> None:
        from onnx import helper, numpy_helper

        self.helper = helper
        self.numpy_helper = numpy_helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0
        self._data = data  # the external-data file, written as constants arrive
        self._data_name = data_name

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def const(self, name: str, value: np.ndarray) -> str:
        """A constant; large ones go straight to the external-data file, so the graph never
        holds the weights (small ones stay inline: shape inference reads them)."""
        value = np.ascontiguousarray(value)
        if value.nbytes < _INLINE_BYTES:
            self.initializers.append(self.numpy_helper.from_array(value, name))
            return name
        from onnx import TensorProto

        offset = -(-self._data.tell() // _DATA_ALIGN) * _DATA_ALIGN
        self._data.seek(offset)
        self._data.write(value.tobytes())
        tensor = TensorProto(name=name, dims=value.shape)
        tensor.data_type = self.helper.np_dtype_to_tensor_dtype(value.dtype)
        tensor.data_location = TensorProto.EXTERNAL
        for key, v in (("location", self._data_name), ("offset", offset), ("length", value.nbytes)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(v)
        self.initializers.append(tensor)
        return name

    def node(
        self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any
    ) -> list[str]:
        outs = [self.name(op) for _ in range(n_out)]
        self.node_named(op, inputs, outs, domain, **attrs)
        return outs

    def node_named(
        self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs: Any
    ) -> None:
        self.nodes.append(
            self.helper.make_node(
                op, inputs, outputs, name=self.name(op + "_node"), domain=domain or None, **attrs
            )
        )


def build_onnx_from_gguf(
    src: str | Path,
    out_dir: str | Path,
    *,
    quant: str = "keep",
    head_bits: int | None = None,
    max_context: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> BuildReport:
    """Write ``model.onnx`` + ``model.onnx.data`` for ``src`` — a GGUF file, or a Hugging Face
    folder with safetensors weights — into ``out_dir`` (which must exist).

    ``quant``: ``keep`` the source's weights exactly (GGUF blocks transcoded, floats as
    floats; block types without an exact form are widened), re-round every projection to
    symmetric ``int4``/``int8`` blocks (``head_bits=8`` keeps the embedding and the output
    projection at 8 bits), or widen everything to ``fp32``. ``on_progress(done, total)``
    counts the source's tensors as they are written. Returns what was kept in blocks and
    what was widened."""
    if quant not in QUANTS:
        raise ConversionError(
            f"the native builder writes --quant {', '.join(QUANTS)}, not {quant!r}"
        )
    if head_bits not in (None, 4, 8):
        raise ConversionError(f"head_bits={head_bits!r}: use 4 or 8")
    out, src = Path(out_dir), Path(src)
    total = 0
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done, total)

    with contextlib.ExitStack() as stack:
        if src.is_dir():
            from edgeinfer.converters.hf_source import checkpoint_tensors

            header, tensors = stack.enter_context(checkpoint_tensors(src, progress))
        else:
            header = read_gguf_header(src)
            tensors = _Tensors(header, progress)
        total = len(header.tensors)
        data = stack.enter_context(open(out / "model.onnx.data", "wb"))
        return _build(header, tensors, out, data, quant, head_bits, max_context)


def _build(
    header: GGUFHeader,
    tensors: Any,
    out: Path,
    data: Any,
    quant: str,
    head_bits: int | None,
    max_context: int | None,
) -> BuildReport:
    import onnx
    from onnx import TensorProto

    shape = gguf_shape(header)
    progress = tensors.on_read
    context = min(max_context or shape.context, shape.context)
    report = BuildReport(header.architecture, shape.layers, {}, {}, context, shape)
    g = _Graph(data, "model.onnx.data")

    def need(name: str) -> TensorInfo:
        t = tensors.info(name)
        if t is None:
            raise ConversionError(f"{header.path.name}: tensor {name} is missing")
        return t

    block_sums: dict[str, str] = {}  # input -> its sums over 32-wide blocks
    summers: dict[int, str] = {}  # k -> the 0/1 matrix [k, k / 32] that sums blocks

    def sums_of(x: str, k: int) -> str:
        """x's sums over 32-wide blocks of its last axis: one MatMul with a 0/1 matrix (one
        node is cheaper per decode step than Reshape + ReduceSum)."""
        if k not in summers:
            blocks = k // OFFSET_BLOCK
            ones = np.zeros((k, blocks), np.float32)
            ones[np.arange(k), np.arange(k) // OFFSET_BLOCK] = 1.0
            summers[k] = g.const(f"block_sum_{k}", ones)
        if x not in block_sums:
            block_sums[x] = g.node("MatMul", [x, summers[k]])[0]
        return block_sums[x]

    bits = {"int4": 4, "int8": 8}.get(quant)
    head_nbits = head_bits or bits  # the embedding and the output projection

    def weights(t: TensorInfo) -> NBitsWeight | None:
        if quant == "fp32":
            return None
        if bits is not None:
            is_head = t.name in ("output.weight", "token_embd.weight")
            return quantize_symmetric(tensors.floats(t), int(head_nbits if is_head else bits))
        if t.ggml_type in (F32, F16, BF16):
            return None
        k, n = t.shape[0], t.shape[1]
        w = transcode(t.ggml_type, tensors.raw(t), n, k)
        if w is None:
            report.widened[t.name] = f"GGML type {t.ggml_type} has no exact MatMulNBits form"
        return w

    def linear(x: str, ts: list[TensorInfo], stem: str) -> str:
        """x @ [W1; W2; ...].T for GGUF weights ([n rows of k]) that share the input x: one
        MatMulNBits over their rows together when their blocks have one form."""
        return transcoded_linear(x, [(t, weights(t)) for t in ts], stem)

    def transcoded_linear(
        x: str, pairs: list[tuple[TensorInfo, NBitsWeight | None]], stem: str
    ) -> str:
        forms = {(w.bits, w.block_size) if w is not None else None for _, w in pairs}
        if len(forms) > 1 or None in forms:
            if len(pairs) > 1:
                outs = [transcoded_linear(x, [p], f"{stem}.{i}") for i, p in enumerate(pairs)]
                return g.node("Concat", outs, axis=-1)[0]
            w = g.const(f"{stem}.weight_t", tensors.floats(pairs[0][0]).T.copy())
            return g.node("MatMul", [x, w])[0]
        parts = [w for _, w in pairs if w is not None]
        for w in parts:
            key = f"{w.bits}-bit/{w.block_size}"
            report.nbits[key] = report.nbits.get(key, 0) + 1
        first = parts[0]
        n = sum(w.n for w in parts)
        y = g.node(
            "MatMulNBits",
            [
                x,
                g.const(f"{stem}.qweight", np.concatenate([w.packed for w in parts])),
                g.const(f"{stem}.scales", np.concatenate([w.scales.reshape(-1) for w in parts])),
            ],
            domain="com.microsoft",
            K=first.k,
            N=n,
            bits=first.bits,
            block_size=first.block_size,
            accuracy_level=ACCURACY_LEVEL,
        )[0]
        if all(w.offset is None for w in parts):
            return y
        # + blocksum32(x) @ offset.T: the per-block minimums, exact
        blocks = first.k // OFFSET_BLOCK
        offset = np.concatenate(
            [
                w.offset if w.offset is not None else np.zeros((w.n, blocks), np.float32)
                for w in parts
            ]
        )
        term = g.node("MatMul", [sums_of(x, first.k), g.const(f"{stem}.offset_t", offset.T.copy())])
        return g.node("Add", [y, term[0]])[0]

    def rms(x: str, name: str) -> str:
        w = g.const(name, tensors.floats(need(name)))
        return g.node(
            "SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=shape.eps, stash_type=1
        )[0]

    def add_rms(residual: str, y: str, name: str) -> tuple[str, str]:
        """(RMSNorm(residual + y), residual + y) in one node."""
        w = g.const(name, tensors.floats(need(name)))
        normed, _, _, total = g.node(
            "SkipSimplifiedLayerNormalization",
            [residual, y, w],
            n_out=4,
            domain="com.microsoft",
            epsilon=shape.eps,
        )
        return normed, total

    # inputs
    inputs = [
        g.helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence_length"]),
        g.helper.make_tensor_value_info(
            "attention_mask", TensorProto.INT64, [1, "total_sequence_length"]
        ),
    ]
    outputs = [g.helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, shape.vocab])]
    kv_dims = [1, shape.kv_heads, "past_sequence_length", shape.head_dim]
    present_dims = [1, shape.kv_heads, "total_sequence_length", shape.head_dim]
    for i in range(shape.layers):
        for kind in ("key", "value"):
            inputs.append(
                g.helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT, kv_dims
                )
            )
            outputs.append(
                g.helper.make_tensor_value_info(
                    f"present.{i}.{kind}", TensorProto.FLOAT, present_dims
                )
            )

    # attention bookkeeping from the mask: seqlens_k = cached + new - 1, total length
    mask_sum = g.node(
        "ReduceSum", ["attention_mask", g.const("axis1", np.array([1], np.int64))], keepdims=0
    )[0]
    minus_one = g.node("Sub", [mask_sum, g.const("one64", np.array(1, np.int64))])[0]
    seqlens_k = g.node("Cast", [minus_one], to=TensorProto.INT32)[0]
    mask_shape = g.node("Shape", ["attention_mask"])[0]
    total_len = g.node("Gather", [mask_shape, g.const("idx1", np.array(1, np.int64))], axis=0)[0]
    total_len32 = g.node("Cast", [total_len], to=TensorProto.INT32)[0]
    halves = g.const("ffn_halves", np.array([shape.ffn, shape.ffn], np.int64))
    qkv_rows = (shape.heads * shape.head_dim, *(2 * [shape.kv_heads * shape.head_dim]))
    cos, sin = _rotary_cache(shape.rope_dim, shape.rope_base, shape.rope_scale, context)
    cos_name, sin_name = g.const("cos_cache", cos), g.const("sin_cache", sin)
    gemma = header.architecture == "gemma3"
    swa_cos = swa_sin = ""
    if gemma and shape.swa_pattern:  # sliding-window layers rotate with their own base
        cos, sin = _rotary_cache(shape.rope_dim, shape.rope_base_swa, 1.0, context)
        swa_cos, swa_sin = g.const("cos_cache_swa", cos), g.const("sin_cache_swa", sin)

    # embedding: Q8_0/Q4_0 blocks gathered as they are (GatherBlockQuantized, exact), shared
    # with a tied lm_head; other types as a float table
    embd = need("token_embd.weight")
    table = embd_blocks = None
    if bits is not None:
        embd_blocks = quantize_symmetric(tensors.floats(embd), int(head_nbits))
    elif quant == "keep" and embd.ggml_type in (Q8_0, Q4_0):
        embd_blocks = transcode(embd.ggml_type, tensors.raw(embd), shape.vocab, shape.hidden)
    if embd_blocks is not None:
        packed = g.const("token_embd.qweight", embd_blocks.packed)
        rows = g.node(
            "Reshape", [packed, g.const("embd_rows", np.array([shape.vocab, -1], np.int64))]
        )
        x = g.node(
            "GatherBlockQuantized",
            [rows[0], "input_ids", g.const("token_embd.scales", embd_blocks.scales)],
            domain="com.microsoft",
            gather_axis=0,
            quantize_axis=1,
            block_size=embd_blocks.block_size,
            bits=embd_blocks.bits,
        )[0]
    else:
        table = g.const("token_embd.weight", tensors.floats(embd))
        x = g.node("Gather", [table, "input_ids"], axis=0)[0]
    if gemma:  # Gemma scales the embedding by sqrt(hidden), as llama.cpp does in float32
        x = g.node(
            "Mul", [x, g.const("embd_scale", np.array(math.sqrt(shape.hidden), np.float32))]
        )[0]

    def head_rms(y: str, heads: int, name: str) -> str:
        """RMSNorm of each head's vector (Gemma 3's q/k norms)."""
        per_head = g.node(
            "Reshape",
            [y, g.const(g.name("heads"), np.array([0, 0, heads, shape.head_dim], np.int64))],
        )[0]
        normed = rms(per_head, name)
        flat = np.array([0, 0, heads * shape.head_dim], np.int64)
        return g.node("Reshape", [normed, g.const(g.name("flat"), flat)])[0]

    down = ""  # the previous layer's MLP output, joined to the residual by the next norm
    for i in range(shape.layers):
        p = f"blk.{i}"
        if i == 0:
            h = rms(x, f"{p}.attn_norm.weight")
        else:
            h, x = add_rms(x, down, f"{p}.attn_norm.weight")
        qkv = linear(h, [need(f"{p}.attn_{w}.weight") for w in ("q", "k", "v")], f"{p}.attn_qkv")
        biases = [tensors.info(f"{p}.attn_{w}.bias") for w in ("q", "k", "v")]
        if any(b is not None for b in biases):  # Qwen2
            bias = np.concatenate(
                [_bias(tensors, b, n) for b, n in zip(biases, qkv_rows, strict=True)]
            )
            qkv = g.node("Add", [qkv, g.const(f"{p}.attn_qkv.bias", bias)])[0]
        attention_inputs = [qkv, "", ""]  # packed: query, key and value in one tensor
        swa = shape.is_swa(i)
        if gemma:
            q, k, v = g.node(
                "Split",
                [qkv, g.const(g.name("qkv_rows"), np.array(qkv_rows, np.int64))],
                n_out=3,
                axis=-1,
            )
            q = head_rms(q, shape.heads, f"{p}.attn_q_norm.weight")
            k = head_rms(k, shape.kv_heads, f"{p}.attn_k_norm.weight")
            attention_inputs = [q, k, v]
        attn = g.name(f"{p}.attn")
        g.node_named(
            "GroupQueryAttention",
            [
                *attention_inputs,
                f"past_key_values.{i}.key",
                f"past_key_values.{i}.value",
                seqlens_k,
                total_len32,
                swa_cos if swa else cos_name,
                swa_sin if swa else sin_name,
            ],
            [attn, f"present.{i}.key", f"present.{i}.value"],
            domain="com.microsoft",
            num_heads=shape.heads,
            kv_num_heads=shape.kv_heads,
            scale=shape.attention_scale or 1.0 / math.sqrt(shape.head_dim),
            do_rotary=1,
            rotary_interleaved=int(shape.rotary_interleaved),
            local_window_size=shape.sliding_window if swa else -1,
        )
        o = linear(attn, [need(f"{p}.attn_output.weight")], f"{p}.attn_output")
        if gemma:  # Gemma normalizes each block's output before the residual
            o = rms(o, f"{p}.post_attention_norm.weight")
        h, x = add_rms(x, o, f"{p}.ffn_norm.weight")
        gate_up = linear(
            h, [need(f"{p}.ffn_gate.weight"), need(f"{p}.ffn_up.weight")], f"{p}.ffn_gate_up"
        )
        gate, up = g.node("Split", [gate_up, halves], n_out=2, axis=-1)
        if gemma:  # GELU, tanh approximation (llama.cpp's ggml_gelu)
            act = g.node("Gelu", [gate], approximate="tanh")[0]
        else:  # SiLU
            act = g.node("Mul", [gate, g.node("Sigmoid", [gate])[0]])[0]
        down = linear(g.node("Mul", [act, up])[0], [need(f"{p}.ffn_down.weight")], f"{p}.ffn_down")
        if gemma:
            down = rms(down, f"{p}.post_ffw_norm.weight")
    x = g.node("Add", [x, down])[0]  # the last layer's MLP output

    # the last position only, then the final norm and the vocabulary projection
    last = g.node(
        "Slice",
        [
            x,
            g.const("last_start", np.array([-1], np.int64)),
            g.const("last_end", np.array([np.iinfo(np.int64).max], np.int64)),
            g.const("last_axis", np.array([1], np.int64)),
        ],
    )[0]
    h = rms(last, "output_norm.weight")
    head = tensors.info("output.weight") or embd
    if head is embd and embd_blocks is not None:  # tied: the same blocks as the embedding
        w = embd_blocks
        key = f"{w.bits}-bit/{w.block_size}"
        report.nbits[key] = report.nbits.get(key, 0) + 1
        logits = g.node(
            "MatMulNBits",
            [h, "token_embd.qweight", g.const("output.scales", w.scales.reshape(-1))],
            domain="com.microsoft",
            K=w.k,
            N=w.n,
            bits=w.bits,
            block_size=w.block_size,
            accuracy_level=ACCURACY_LEVEL,
        )[0]
    elif head is embd and table is not None:
        flat = g.node("Reshape", [h, g.const("flat_shape", np.array([1, shape.hidden], np.int64))])
        logits2d = g.node("Gemm", [flat[0], table], transB=1)[0]
        logits = g.node(
            "Reshape", [logits2d, g.const("logits_shape", np.array([1, 1, shape.vocab], np.int64))]
        )[0]
    else:
        logits = linear(h, [head], "output")
    g.node_named("Identity", [logits], ["logits"])
    for t in header.tensors:  # tensors the graph does not use (rope_freqs, ...) count as done
        if t.name not in tensors.seen:
            tensors.seen.add(t.name)
            progress()

    graph = g.helper.make_graph(g.nodes, "edgeinfer-decoder", inputs, outputs, g.initializers)
    model = g.helper.make_model(
        graph,
        opset_imports=[g.helper.make_opsetid("", 21), g.helper.make_opsetid("com.microsoft", 1)],
        producer_name="edgeinfer",
    )
    model.ir_version = 10
    onnx.save_model(model, str(out / "model.onnx"))  # the weights are already in the data file
    return report


def _bias(tensors: _Tensors, t: TensorInfo | None, n: int) -> np.ndarray:
    if t is None:
        return np.zeros(n, np.float32)
    b = tensors.floats(t).reshape(-1)
    if b.shape != (n,):
        raise ConversionError(f"tensor {t.name} has {b.size} values, expected {n}")
    return b


def _rotary_cache(
    dim: int, base: float, scale: float, context: int
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [context, dim / 2] for GQA's rotary embedding; positions divided by
    ``scale`` (linear rope scaling)."""
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = np.outer(np.arange(context, dtype=np.float64) / scale, inv)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
