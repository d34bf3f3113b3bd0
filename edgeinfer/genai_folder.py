"""Folders made by onnxruntime-genai's model builder (``genai_config.json`` + ``model.onnx``)
read as edgeinfer manifests, so models published in that format get edgeinfer's provider
selection, memory plan and generator.

Such a graph takes ``input_ids``, ``attention_mask`` and ``past_key_values.N.key/value`` and
returns ``logits`` and ``present.N.key/value``: the names edgeinfer's ONNX backend drives.
With ``past_present_share_buffer`` (GroupQueryAttention graphs) the cache is one buffer of the
whole context, written in place. Nothing is written into the folder: the manifest lives in
memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ModelLoadError
from .manifest import Manifest, parse_manifest

__all__ = ["GENAI_CONFIG", "manifest_from_genai_folder"]

GENAI_CONFIG = "genai_config.json"
_NAMES = {
    ("inputs", "input_ids"): "input_ids",
    ("inputs", "attention_mask"): "attention_mask",
    ("inputs", "past_key_names"): "past_key_values.%d.key",
    ("inputs", "past_value_names"): "past_key_values.%d.value",
    ("outputs", "logits"): "logits",
    ("outputs", "present_key_names"): "present.%d.key",
    ("outputs", "present_value_names"): "present.%d.value",
}
_KV_TYPES = {1: "float32", 10: "float16"}  # onnx TensorProto element types


def manifest_from_genai_folder(folder: Path) -> Manifest:
    """The manifest of the onnxruntime-genai folder ``folder``; ModelLoadError naming the
    field when the folder is not one edgeinfer's ONNX backend can drive."""
    where = str(folder / GENAI_CONFIG)
    config = _read_json(folder / GENAI_CONFIG)
    model = _mapping(config, "model", where)
    decoder = _mapping(model, "decoder", where, "model.")
    search = config.get("search", {}) if isinstance(config.get("search"), dict) else {}
    for (side, key), expected in _NAMES.items():
        names = decoder.get(side, {})
        got = names.get(key, expected) if isinstance(names, dict) else None
        if got != expected:
            raise ModelLoadError(
                f"{where}: model.decoder.{side}.{key}={got!r}; edgeinfer drives graphs whose "
                f"tensor is named {expected!r} (a decoder-only model with a KV cache)"
            )
    inputs = decoder.get("inputs", {})
    has_positions = isinstance(inputs, dict) and "position_ids" in inputs
    filename = decoder.get("filename", "model.onnx")
    tok = _read_json(folder / "tokenizer_config.json", required=False)
    eos = model.get("eos_token_id", [])
    eos_ids = eos if isinstance(eos, list) else [eos]
    data: dict[str, Any] = {
        "format": "onnx",
        "model_file": filename,
        "architecture": {
            "model_type": model.get("type"),
            "num_layers": decoder.get("num_hidden_layers"),
            "num_kv_heads": decoder.get("num_key_value_heads"),
            "head_dim": decoder.get("head_size"),
            "hidden_size": decoder.get("hidden_size"),
            "max_context": model.get("context_length"),
            "vocab_size": model.get("vocab_size"),
            "kv_dtype": _kv_dtype(folder / str(filename)),
            "kv_cache": "shared" if search.get("past_present_share_buffer") else "grow",
        },
        "tokenizer_file": "tokenizer.json",
        "chat_template_file": "chat_template.jinja"
        if (folder / "chat_template.jinja").is_file()
        else None,
        "bos_token": _token_text(tok.get("bos_token")),
        "eos_token": _token_text(tok.get("eos_token")),
        "eos_token_ids": eos_ids,
        "has_position_ids": has_positions,
        "source": {"kind": "onnxruntime-genai", "path": str(folder)},
        "quantization": {"method": "onnxruntime-genai"},
    }
    return parse_manifest(data, where=where)


def _kv_dtype(path: Path) -> str:
    """The cache's element type, read from the graph's first past input (fp16 graphs are
    built for GPUs)."""
    try:
        import onnx
    except ImportError:
        return "float32"
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError and others for a damaged file
        raise ModelLoadError(f"cannot read the ONNX graph {path}: {exc}") from exc
    for value in graph.input:
        if value.name.startswith("past_key_values."):
            elem = value.type.tensor_type.elem_type
            if elem not in _KV_TYPES:
                raise ModelLoadError(
                    f"{path}: its KV cache has element type {elem}; edgeinfer drives float32 "
                    "and float16 caches"
                )
            return _KV_TYPES[elem]
    return "float32"


def _read_json(path: Path, *, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _mapping(data: dict[str, Any], key: str, where: str, prefix: str = "") -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{where}: {prefix}{key} must be a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
