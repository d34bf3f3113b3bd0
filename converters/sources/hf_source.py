"""A Hugging Face safetensors folder seen by the native builder as if it were a GGUF: its
config as GGUF metadata, its tensors under llama.cpp's names, read one at a time.

Two differences from a GGUF of the same model are carried over: Llama's q/k rows are in the
checkpoint's own order (rotated by halves, not the adjacent pairs llama.cpp's converter
permutes them into), and Gemma's RMSNorm weights are stored without the +1 that Gemma's
norm adds at run time (llama.cpp's files store it added; so does this view).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.files.gguf_file import GGUFHeader, TensorInfo

from .hf_config import read_json_object, read_model_config
from .safetensors_reader import SafetensorsIndex, open_checkpoint

__all__ = ["HF_ARCHITECTURES", "ROTARY_KEY", "checkpoint_tensors"]

# model_type -> the builder's architecture
HF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
}
ROTARY_KEY = "edgeinfer.rotary_interleaved"  # metadata the builder reads before its default
_F32, _F16, _BF16 = 0, 1, 30
_GGML = {"F32": _F32, "F16": _F16, "BF16": _BF16, "F64": _F32}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GEMMA_LAYER_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _gguf_name(hf: str, arch: str) -> str | None:
    if hf in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        return "token_embd.weight"
    if hf in ("model.norm.weight", "model.language_model.norm.weight"):
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    m = _LAYER.fullmatch(hf.replace("model.language_model.", "model."))
    if m is None:
        return None
    layer, rest = m.groups()
    names = dict(_LAYER_NAMES)
    if arch == "gemma3":
        names |= _GEMMA_LAYER_NAMES
    else:
        names["post_attention_layernorm.weight"] = "ffn_norm.weight"
    name = names.get(rest)
    return f"blk.{layer}.{name}" if name else None


class CheckpointTensors:
    """The builder's tensor source over a safetensors index (as ``builder.tensors.GGUFTensors``)."""

    def __init__(
        self,
        header: GGUFHeader,
        index: SafetensorsIndex,
        hf_names: dict[str, str],
        arch: str,
        on_read: Callable[[], None],
    ) -> None:
        self.header = header
        self._index = index
        self._hf = hf_names
        self._by_name = {t.name: t for t in header.tensors}
        self._gemma = arch == "gemma3"
        self.on_read = on_read
        self.seen: set[str] = set()

    def info(self, name: str) -> TensorInfo | None:
        return self._by_name.get(name)

    def raw(self, t: TensorInfo) -> np.ndarray:
        raise ConversionError(f"tensor {t.name} holds floats, not GGUF blocks")

    def floats(self, t: TensorInfo) -> np.ndarray:
        hf = self._hf[t.name]
        value = np.array(self._index.read(hf), dtype=np.float32)
        self._index.release(hf)
        if self._gemma and t.name.endswith("norm.weight"):
            value = value + 1.0  # Gemma's RMSNorm multiplies by (1 + weight)
        if t.name not in self.seen:
            self.seen.add(t.name)
            self.on_read()
        return value


@contextmanager
def checkpoint_tensors(
    folder: Path, on_read: Callable[[], None]
) -> Iterator[tuple[GGUFHeader, CheckpointTensors]]:
    """The folder's config as a GGUF header and its tensors as the builder reads them."""
    hp = read_model_config(folder / "config.json")
    arch = HF_ARCHITECTURES.get(hp.model_type)
    if arch is None:
        raise ConversionError(
            f"{folder}: model_type {hp.model_type!r} is not supported by the native ONNX builder "
            f"(supported: {', '.join(sorted(HF_ARCHITECTURES))}); use --builder optimum"
        )
    raw = read_json_object(folder / "config.json")
    with open_checkpoint(folder) as index:
        tensors: list[TensorInfo] = []
        hf_names: dict[str, str] = {}
        for hf in index.names():
            name = _gguf_name(hf, arch)
            if name is None:
                continue
            entry = index.entries[hf]
            ggml = _GGML.get(entry.dtype)
            if ggml is None:
                raise ConversionError(
                    f"{folder}: tensor {hf} is {entry.dtype}; the native builder reads F32, F16, "
                    "BF16 and F64 weights"
                )
            tensors.append(TensorInfo(name, tuple(reversed(entry.shape)), ggml, 0))
            hf_names[name] = hf
        header = GGUFHeader(folder, 3, 0, 0, _metadata(hp, raw, arch), tuple(tensors))
        yield header, CheckpointTensors(header, index, hf_names, arch, on_read)


def _metadata(hp: Any, raw: dict[str, Any], arch: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.embedding_length": hp.hidden_size,
        f"{arch}.attention.head_count": hp.num_attention_heads,
        f"{arch}.attention.head_count_kv": hp.num_key_value_heads,
        f"{arch}.attention.key_length": hp.head_dim,
        f"{arch}.block_count": hp.num_hidden_layers,
        f"{arch}.feed_forward_length": hp.require_intermediate_size(),
        f"{arch}.attention.layer_norm_rms_epsilon": hp.rms_norm_eps,
        f"{arch}.rope.freq_base": hp.rope_theta,
        f"{arch}.context_length": hp.max_position_embeddings,
        ROTARY_KEY: False,  # the checkpoint's q/k rows rotate by halves
    }
    scaling = hp.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear" and scaling.get("factor"):
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(scaling["factor"])
    if arch == "gemma3":
        window = raw.get("sliding_window")
        types = raw.get("layer_types")
        pattern = raw.get("sliding_window_pattern")
        if isinstance(types, list) and "full_attention" in types:
            pattern = types.index("full_attention") + 1
        if isinstance(window, int) and window > 0:
            meta[f"{arch}.attention.sliding_window"] = window
            meta[f"{arch}.attention.sliding_window_pattern"] = int(pattern or 6)
        meta[f"{arch}.rope.freq_base_swa"] = float(raw.get("rope_local_base_freq", 10000.0))
        scalar = raw.get("query_pre_attn_scalar")
        if isinstance(scalar, (int, float)) and scalar > 0:
            meta["edgeinfer.attention_scale"] = float(scalar) ** -0.5
    return meta
