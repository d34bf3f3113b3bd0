"""Hugging Face checkpoint -> GGUF, and GGUF -> quantized GGUF through llama.cpp, without torch.

The writer handles the Llama family (Llama, Mistral, SmolLM: architecture ``llama``; Qwen2:
``qwen2``) with byte-level BPE tokenizers. Weights are read from the safetensors files through
a memory map one tensor at a time and written with the ``gguf`` package's writer in two
passes (tensor table first, then each tensor's data), so peak memory stays near the largest
tensor rather than the model.

Layout differences handled: Hugging Face Llama/Mistral checkpoints order each attention
head's query and key rows as [first halves of the rotary pairs; second halves]; llama.cpp's
rotary embedding (for ``llama``) pairs neighbouring rows, so Q and K rows are interleaved
per head. Qwen2 uses llama.cpp's NeoX-style rotary embedding, which pairs halves: no change.

Quantization to q4_0, q4_1, q5_k_m, q4_k_m, q6_k and q8_0 runs llama.cpp's own quantizer
(``llama_model_quantize`` from llama-cpp-python).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from edgeinfer.errors import ConversionError, ModelLoadError
from edgeinfer.files.gguf_checks import check_gguf_model
from edgeinfer.files.gguf_file import read_gguf_header

from ..atomic import ensure_free_space
from ..sources.hf_config import ModelConfig, read_model_config
from ..sources.safetensors_reader import SafetensorsIndex, open_checkpoint
from .tokenizer import read_vocab, write_vocab

__all__ = [
    "LLAMA_QUANTS",
    "WRITER_TYPES",
    "gguf_architecture",
    "quantize_gguf",
    "write_gguf",
]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

WRITER_TYPES = ("f32", "f16", "bf16", "q8_0")
LLAMA_QUANTS = ("q4_0", "q4_1", "q5_k_m", "q4_k_m", "q6_k", "q8_0")
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_PERMUTED = {"llama"}  # gguf architectures whose Q/K rows are interleaved per head
_ALIGN = 32  # bytes of padding the writer may add per tensor

# llama.cpp's llama_ftype values
_FTYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_k_m": 17, "q4_k_m": 15,
           "q6_k": 18, "bf16": 32}  # fmt: skip


class _Tensor(NamedTuple):
    gguf_name: str
    hf_name: str
    qtype: Any  # gguf.GGMLQuantizationType
    nbytes: int
    stored_shape: tuple[int, ...]
    dtype: np.dtype


def write_gguf(
    checkpoint: Path, out: Path, outtype: str, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Write the checkpoint folder as one GGUF file of ``outtype``; return what was done.

    Everything the checkpoint says is checked before ``out`` is created: config.json, the
    tokenizer, every tensor's byte range and shape against the config, and the free disk
    space."""
    gguf = import_gguf()
    if outtype not in WRITER_TYPES:
        raise ConversionError(f"the GGUF writer makes {', '.join(WRITER_TYPES)}, not {outtype}")
    hp = read_model_config(checkpoint / "config.json")
    arch = gguf_architecture(hp)
    vocab = read_vocab(checkpoint, hp.vocab_size)
    with open_checkpoint(checkpoint) as index:
        plan = _tensor_plan(index, hp.num_hidden_layers, hp.tie_word_embeddings)
        tensors = [_tensor(gguf, outtype, g, h, _checked_shape(index, h, g, hp)) for g, h in plan]
        metadata = (checkpoint / "tokenizer.json").stat().st_size + 2**16  # a generous bound
        ensure_free_space(out, sum(t.nbytes + _ALIGN for t in tensors) + metadata)
        writer = gguf.GGUFWriter(str(out), arch)
        try:
            _add_metadata(writer, gguf, hp, outtype, checkpoint.name)
            write_vocab(writer, vocab)
            for t in tensors:
                writer.add_tensor_info(t.gguf_name, t.stored_shape, t.dtype, t.nbytes,
                                       raw_dtype=t.qtype)  # fmt: skip
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            _write_tensors(writer, gguf, index, tensors, hp, progress)
        finally:
            writer.close()
    return {"method": outtype, "architecture": arch, "tensors": len(plan),
            "tokenizer": vocab.summary()}  # fmt: skip


def gguf_architecture(hp: ModelConfig) -> str:
    """llama.cpp's architecture for the checkpoint, or ConversionError if it is not written."""
    arch = _ARCHITECTURES.get(hp.model_type)
    if arch is None:
        raise ConversionError(
            f"{hp.path}: model_type {hp.model_type!r:.40} is not supported by the GGUF writer "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))}); convert it to ONNX instead"
        )
    if hp.rope_scaling:
        raise ConversionError(
            f"{hp.path}: rope_scaling {hp.rope_scaling!r:.80} is not supported by the GGUF "
            "writer yet"
        )
    hp.require_intermediate_size()
    return arch


def import_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ConversionError(
            "writing GGUF needs the gguf package (no torch): pip install gguf tokenizers, or "
            "pip install 'edgeinfer[convert]'"
        ) from exc
    return gguf


def _add_metadata(writer: Any, gguf: Any, hp: ModelConfig, outtype: str, name: str) -> None:
    writer.add_name(hp.name or name)
    writer.add_context_length(hp.max_position_embeddings)
    writer.add_embedding_length(hp.hidden_size)
    writer.add_block_count(hp.num_hidden_layers)
    writer.add_feed_forward_length(hp.require_intermediate_size())
    writer.add_head_count(hp.num_attention_heads)
    writer.add_head_count_kv(hp.num_key_value_heads)
    writer.add_key_length(hp.head_dim)
    writer.add_value_length(hp.head_dim)
    writer.add_rope_dimension_count(hp.head_dim)
    writer.add_rope_freq_base(hp.rope_theta)
    writer.add_layer_norm_rms_eps(hp.rms_norm_eps)
    writer.add_vocab_size(hp.vocab_size)
    writer.add_file_type(_FTYPES[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tensors(
    writer: Any,
    gguf: Any,
    index: SafetensorsIndex,
    tensors: list[_Tensor],
    hp: ModelConfig,
    progress: Progress | None,
) -> None:
    say = progress or (lambda line: logger.info("%s", line))
    permuted = _ARCHITECTURES[hp.model_type] in _PERMUTED
    for i, t in enumerate(tensors, 1):
        data = index.read(t.hf_name)
        if permuted and t.gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hp.num_attention_heads if "attn_q" in t.gguf_name else hp.num_key_value_heads
            data = interleave_rotary_rows(data, heads)
        writer.write_tensor_data(_encode(gguf, data, t.qtype))
        del data
        index.release(t.hf_name)
        if i % 16 == 0 or i == len(tensors):
            say(f"  wrote {i}/{len(tensors)} tensors")


def _expected_shape(gguf_name: str, hp: ModelConfig) -> tuple[int, ...]:
    """The Hugging Face shape [out, in] (or [n]) of a tensor the config implies."""
    q_rows = hp.num_attention_heads * hp.head_dim
    kv_rows = hp.num_key_value_heads * hp.head_dim
    hidden, ffn, vocab = hp.hidden_size, hp.require_intermediate_size(), hp.vocab_size
    kind = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
    return {
        "token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden),
        "output_norm.weight": (hidden,), "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,), "attn_q.weight": (q_rows, hidden),
        "attn_k.weight": (kv_rows, hidden), "attn_v.weight": (kv_rows, hidden),
        "attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,),
        "attn_output.weight": (hidden, q_rows), "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
    }[kind]  # fmt: skip


def _checked_shape(
    index: SafetensorsIndex, hf_name: str, gguf_name: str, hp: ModelConfig
) -> tuple[int, ...]:
    entry = index.entries[hf_name]
    expected = _expected_shape(gguf_name, hp)
    if entry.shape != expected:
        raise ConversionError(
            f"{entry.file.name}: tensor {hf_name} has shape {list(entry.shape)}, but "
            f"{hp.path.name} implies {list(expected)} (vocab_size {hp.vocab_size}, hidden_size "
            f"{hp.hidden_size}, num_attention_heads {hp.num_attention_heads}, "
            f"num_key_value_heads {hp.num_key_value_heads}, head_dim {hp.head_dim}, "
            f"intermediate_size {hp.intermediate_size})"
        )
    return entry.shape


def _tensor(
    gguf: Any, outtype: str, gguf_name: str, hf_name: str, shape: tuple[int, ...]
) -> _Tensor:
    qtype = _tensor_type(gguf, outtype, gguf_name, shape)
    nbytes, stored_shape, dtype = _stored(gguf, shape, qtype)
    return _Tensor(gguf_name, hf_name, qtype, nbytes, stored_shape, dtype)


def interleave_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Q/K rows from Hugging Face's half-split rotary order to llama.cpp's interleaved order.

    Per head, rows [r0 .. r(d/2-1), s0 .. s(d/2-1)] become [r0, s0, r1, s1, ...]: each
    rotary pair ends up in neighbouring rows. Works on weights [rows, cols] and biases [rows].
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    shaped = weight.reshape(n_heads, 2, half, *weight.shape[1:])
    return np.ascontiguousarray(shaped.swapaxes(1, 2)).reshape(weight.shape)


def _tensor_plan(index: SafetensorsIndex, n_layer: int, tied: bool) -> list[tuple[str, str]]:
    """(gguf name, checkpoint name) for every tensor to write, in file order."""
    names = set(index.names())
    prefix = "model." if "model.embed_tokens.weight" in names else ""
    plan = [("token_embd.weight", f"{prefix}embed_tokens.weight")]
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    for layer in range(n_layer):
        for gguf_name, hf_name in per_layer.items():
            full = f"{prefix}layers.{layer}.{hf_name}"
            if full in names:
                plan.append((f"blk.{layer}.{gguf_name}", full))
            elif not gguf_name.endswith(".bias"):
                raise ConversionError(f"the checkpoint has no tensor {full}")
    plan.append(("output_norm.weight", f"{prefix}norm.weight"))
    if "lm_head.weight" in names and not tied:
        plan.append(("output.weight", "lm_head.weight"))
    known = {hf for _, hf in plan} | {"lm_head.weight"}
    unknown = sorted(n for n in names - known if not n.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ConversionError(
            f"the checkpoint has tensors the GGUF writer does not know: {', '.join(unknown[:5])}"
        )
    missing = [hf for _, hf in plan if hf not in names]
    if missing:
        raise ConversionError(f"the checkpoint has no tensor {missing[0]}")
    return plan


def _tensor_type(gguf: Any, outtype: str, name: str, shape: tuple[int, ...]) -> Any:
    q = gguf.GGMLQuantizationType
    if len(shape) < 2 or name.endswith(".bias"):
        return q.F32  # norms and biases stay float32, as llama.cpp expects
    if outtype == "q8_0" and shape[-1] % 32 == 0:
        return q.Q8_0
    return {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.F16}[outtype]


def _stored(gguf: Any, shape: tuple[int, ...], qtype: Any) -> tuple[int, tuple[int, ...], Any]:
    q = gguf.GGMLQuantizationType
    if qtype == q.F32:
        return int(np.prod(shape)) * 4, shape, np.dtype(np.float32)
    if qtype == q.F16:
        return int(np.prod(shape)) * 2, shape, np.dtype(np.float16)
    byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
    return int(np.prod(byte_shape)), byte_shape, np.dtype(np.uint8)


def _encode(gguf: Any, data: np.ndarray, qtype: Any) -> np.ndarray:
    q = gguf.GGMLQuantizationType
    if qtype == q.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == q.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return np.asarray(gguf.quants.quantize(np.asarray(data, dtype=np.float32), qtype))


# -- quantization through llama.cpp -----------------------------------------------------------

_TENSOR_LINE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]")


def quantize_gguf(
    src: Path, dst: Path, quant: str, *, threads: int | None, progress: Progress | None = None
) -> dict[str, Any]:
    """Quantize the F32/F16/BF16 GGUF ``src`` to ``dst`` with llama.cpp's quantizer."""
    if quant not in LLAMA_QUANTS:
        raise ConversionError(f"llama.cpp quantization {quant!r} is not one of {LLAMA_QUANTS}")
    from edgeinfer.runtimes.llama_cpp import engine, engine_log_listener

    try:  # llama.cpp's quantizer aborts on some inconsistent files, as its loader does
        check_gguf_model(read_gguf_header(src), error=ConversionError)
    except ModelLoadError as exc:
        raise ConversionError(f"cannot quantize {src.name}: {exc}") from exc

    llama = engine()
    say = progress or (lambda line: logger.info("%s", line))
    params = llama.llama_model_quantize_default_params()
    params.ftype = _FTYPES[quant]
    params.nthread = int(threads or 0)  # 0: llama.cpp picks the hardware threads
    last = [0]
    reasons: list[str] = []  # what llama.cpp said went wrong, for the user's error line

    def on_log(text: str) -> None:
        lowered = text.lower()
        if any(
            word in lowered for word in ("error", "disabled", "failed", "cannot", "unsupported")
        ):
            reasons.append(text.strip())
        match = _TENSOR_LINE.search(text)
        if match:
            done, total = int(match.group(1)), int(match.group(2))
            if done == total or done - last[0] >= max(total // 8, 1):
                last[0] = done
                say(f"  quantized {done}/{total} tensors")

    with engine_log_listener(on_log):
        status = llama.llama_model_quantize(
            str(src).encode(), str(dst).encode(), llama.byref(params)
        )
    if status != 0 or not dst.is_file():
        said = f"; llama.cpp said: {reasons[-1]}" if reasons else "; run with --debug for its log"
        if any("requantizing" in r for r in reasons):
            said += "; quantize from an F16/F32 GGUF or the Hugging Face folder instead"
        raise ConversionError(
            f"llama.cpp could not quantize {src.name} to {quant} (status {status}){said}"
        )
    return {"method": quant, "quantizer": "llama.cpp llama_model_quantize"}
