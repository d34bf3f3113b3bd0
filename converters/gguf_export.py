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

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import ConversionError

from .safetensors_reader import SafetensorsIndex, open_checkpoint

__all__ = ["LLAMA_QUANTS", "WRITER_TYPES", "quantize_gguf", "write_gguf"]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

WRITER_TYPES = ("f32", "f16", "bf16", "q8_0")
LLAMA_QUANTS = ("q4_0", "q4_1", "q5_k_m", "q4_k_m", "q6_k", "q8_0")
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_PERMUTED = {"llama"}  # gguf architectures whose Q/K rows are interleaved per head

# llama.cpp's llama_ftype values
_FTYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_k_m": 17, "q4_k_m": 15,
           "q6_k": 18, "bf16": 32}  # fmt: skip

# Recognised byte-level BPE pre-tokenizers -> llama.cpp's tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOKENIZER_CHECK_TEXT = (
    "Hello world! The quick brown fox, 1234567 apples; Café naïve résumé crème brûlée. "
    "你好\uff0c世界。こんにちは、世界\uff01 Emoji: 🙂🎉🍎 and tabs\tand\nnew lines  double  spaces."
)


def write_gguf(
    checkpoint: Path, out: Path, outtype: str, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Write the checkpoint folder as one GGUF file of ``outtype``; return what was done."""
    try:
        import gguf
    except ImportError as exc:
        raise ConversionError(
            "writing GGUF needs the gguf package (no torch): pip install gguf tokenizers, or "
            "pip install 'edgeinfer[convert]'"
        ) from exc

    say = progress or (lambda line: logger.info("%s", line))
    if outtype not in WRITER_TYPES:
        raise ConversionError(f"the GGUF writer makes {', '.join(WRITER_TYPES)}, not {outtype}")
    config = _read_json(checkpoint / "config.json")
    model_type = str(config.get("model_type", ""))
    arch = _ARCHITECTURES.get(model_type)
    if arch is None:
        raise ConversionError(
            f"{checkpoint}: model_type {model_type!r} is not supported by the GGUF writer "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))}); convert it to ONNX instead"
        )
    if config.get("rope_scaling"):
        raise ConversionError(
            f"{checkpoint}: rope_scaling {config['rope_scaling']} is not supported by the "
            "GGUF writer yet"
        )
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // n_head)
    n_layer = int(config["num_hidden_layers"])

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(str(config.get("_name_or_path") or checkpoint.name))
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(_FTYPES[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer = _add_tokenizer(writer, checkpoint, int(config["vocab_size"]))

    try:
        with open_checkpoint(checkpoint) as index:
            plan = _tensor_plan(index, n_layer, bool(config.get("tie_word_embeddings", False)))
            qtypes = {}
            for gguf_name, hf_name in plan:
                shape = index.entries[hf_name].shape
                qtype = _tensor_type(gguf, outtype, gguf_name, shape)
                qtypes[gguf_name] = qtype
                nbytes, stored_shape, dtype = _stored(gguf, shape, qtype)
                writer.add_tensor_info(gguf_name, stored_shape, dtype, nbytes, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for i, (gguf_name, hf_name) in enumerate(plan, 1):
                data = index.read(hf_name)
                if arch in _PERMUTED and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
                    heads = n_head if gguf_name.endswith("attn_q.weight") else n_kv
                    data = interleave_rotary_rows(data, heads)
                writer.write_tensor_data(_encode(gguf, data, qtypes[gguf_name]))
                del data
                index.release(hf_name)
                if i % 16 == 0 or i == len(plan):
                    say(f"  wrote {i}/{len(plan)} tensors")
    finally:
        writer.close()
    return {
        "method": outtype,
        "architecture": arch,
        "tensors": len(plan),
        "tokenizer": tokenizer,
    }


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


# -- tokenizer -------------------------------------------------------------------------------


def _add_tokenizer(writer: Any, checkpoint: Path, n_vocab: int) -> dict[str, Any]:
    spec = _read_json(checkpoint / "tokenizer.json")
    cfg = _read_json(checkpoint / "tokenizer_config.json", required=False)
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(spec):
        raise ConversionError(
            f"{checkpoint}: only byte-level BPE tokenizers (GPT-2 style: SmolLM, Llama 3, Qwen2) "
            "are supported by the GGUF writer; this one is "
            f"{model.get('type')} without a ByteLevel pre-tokenizer"
        )
    vocab: dict[str, int] = model["vocab"]
    added = {int(t["id"]): t for t in spec.get("added_tokens") or []}
    size = max(n_vocab, max(vocab.values(), default=-1) + 1, max(added, default=-1) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # UNUSED until named
    for text, i in vocab.items():
        tokens[i], types[i] = text, 1  # NORMAL
    for i, tok in added.items():
        tokens[i] = str(tok["content"])
        types[i] = 3 if tok.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = _pre_tokenizer(spec.get("pre_tokenizer"))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)

    def token_id(key: str) -> int | None:
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            ids = [i for i, t in enumerate(tokens) if t == value]
            return ids[0] if ids else None
        return None

    special = {
        "bos": token_id("bos_token"),
        "eos": token_id("eos_token"),
        "unk": token_id("unk_token"),
        "pad": token_id("pad_token"),
    }
    if special["bos"] is not None:
        writer.add_bos_token_id(special["bos"])
    if special["eos"] is not None:
        writer.add_eos_token_id(special["eos"])
    if special["unk"] is not None:
        writer.add_unk_token_id(special["unk"])
    if special["pad"] is not None:
        writer.add_pad_token_id(special["pad"])
    add_bos = _adds_bos(spec, cfg, special["bos"], tokens)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(bool(cfg.get("add_eos_token", False)))
    template = cfg.get("chat_template")
    template_file = checkpoint / "chat_template.jinja"
    if not isinstance(template, str) and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    if isinstance(template, str):
        writer.add_chat_template(template)
    return {"model": "gpt2", "pre": pre, "tokens": size, "merges": len(merges),
            "add_bos": add_bos, **{f"{k}_id": v for k, v in special.items()}}  # fmt: skip


def _adds_bos(
    spec: dict[str, Any], cfg: dict[str, Any], bos: int | None, tokens: list[str]
) -> bool:
    """Whether the tokenizer puts BOS before a text: tokenizer_config's add_bos_token when
    present, else whether tokenizer.json's post-processor template starts with it (Llama 3)."""
    if "add_bos_token" in cfg:
        return bool(cfg["add_bos_token"])
    if bos is None:
        return False
    post = spec.get("post_processor") or {}
    steps = post.get("processors", [post]) if isinstance(post, dict) else []
    for step in steps:
        single = step.get("single") if isinstance(step, dict) else None
        if single:
            first = single[0].get("SpecialToken", {}) if isinstance(single[0], dict) else {}
            return first.get("id") == tokens[bos]
    return False


def _is_byte_level(spec: dict[str, Any]) -> bool:
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    return '"ByteLevel"' in text


def _pre_tokenizer(node: Any) -> str:
    """llama.cpp's name for the pre-tokenizer, or ConversionError if it is not one it knows."""
    parts = node.get("pretokenizers", [node]) if isinstance(node, dict) else []
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        pattern = (parts[0].get("pattern") or {}).get("Regex", "")
        if pattern == _LLAMA3_SPLIT:
            return "llama-bpe"
        if pattern == _QWEN2_SPLIT:
            return "qwen2"
    raise ConversionError(
        f"the tokenizer's pre-tokenizer ({', '.join(map(str, kinds)) or 'none'}) is not one "
        "the GGUF writer knows (GPT-2, SmolLM, Llama 3, Qwen2)"
    )


def _read_json(path: Path, *, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConversionError(f"{path} is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


# -- quantization through llama.cpp -----------------------------------------------------------

_TENSOR_LINE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]")


def quantize_gguf(
    src: Path, dst: Path, quant: str, *, threads: int | None, progress: Progress | None = None
) -> dict[str, Any]:
    """Quantize the F32/F16/BF16 GGUF ``src`` to ``dst`` with llama.cpp's quantizer."""
    if quant not in LLAMA_QUANTS:
        raise ConversionError(f"llama.cpp quantization {quant!r} is not one of {LLAMA_QUANTS}")
    from edgeinfer.runtimes.llama_cpp import _engine, engine_log_listener

    llama, _ = _engine()
    say = progress or (lambda line: logger.info("%s", line))
    params = llama.llama_model_quantize_default_params()
    params.ftype = _FTYPES[quant]
    params.nthread = int(threads or 0)  # 0: llama.cpp picks the hardware threads
    last = [0]

    def on_log(text: str) -> None:
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
        raise ConversionError(
            f"llama.cpp could not quantize {src.name} to {quant} (status {status}); run with "
            "--debug for the engine's log"
        )
    return {"method": quant, "quantizer": "llama.cpp llama_model_quantize"}
