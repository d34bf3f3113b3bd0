"""Folders made by onnxruntime-genai's model builder (``genai_config.json`` + ``model.onnx``)
read as edgeinfer manifests, so models published in that format get edgeinfer's provider
selection, memory plan and generator.

Such a graph takes ``input_ids``, ``attention_mask`` and ``past_key_values.N.key/value`` and
returns ``logits`` and ``present.N.key/value``: the names edgeinfer's ONNX backend drives.
With ``past_present_share_buffer`` (GroupQueryAttention graphs) the cache is one buffer of the
whole context, written in place. Such a graph whose inputs have a batch axis (the builder's
``batch_size``) also loads with ``parallel > 1``: one buffer row per sequence slot, each row's
length read from its mask row. A growing cache (``past_present_share_buffer`` false) drives one
sequence; the backend refuses it at ``parallel > 1``. Nothing is written into the folder: the
manifest lives in memory.

The folder comes from a stranger: every file it names is checked to lie inside it (no
``..``, no absolute path, no symlink leading out) and to be a regular file before anything
opens it, the JSON files are parsed with bounds, and ``model.context_length`` must fit the
graph's rotary cache — a longer context would load, then fail mid-reply, so it is refused
at load (``ModelLoadError``), not silently capped.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..bounded_json import read_json_file
from ..errors import ModelLoadError
from .manifest import Manifest, parse_manifest, resolve_inside

__all__ = ["GENAI_CONFIG", "manifest_from_genai_folder"]

GENAI_CONFIG = "genai_config.json"
_TOKENIZER_CONFIG = "tokenizer_config.json"
_CHAT_TEMPLATE = "chat_template.jinja"
_MAX_CONFIG_BYTES = 1 << 20  # genai_config.json: ~2 KB from the builder
_MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # inline chat templates and added-token tables
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
    config = _read_object(folder, GENAI_CONFIG, _MAX_CONFIG_BYTES, where=str(folder))
    model = _mapping(config, "model", where)
    decoder = _mapping(model, "decoder", where, "model.")
    search = config.get("search", {}) if isinstance(config.get("search"), dict) else {}
    _check_tensor_names(decoder, where)
    inputs = decoder.get("inputs", {})
    has_positions = isinstance(inputs, dict) and "position_ids" in inputs
    filename = decoder.get("filename", "model.onnx")
    # checked before anything opens it: inside the folder, a regular file
    graph = resolve_inside(folder, filename, "model.decoder.filename", where=where)
    facts = _graph_facts(graph, where)
    _check_rotary_context(model.get("context_length"), facts, filename, where)
    tok = _read_object(folder, _TOKENIZER_CONFIG, _MAX_TOKENIZER_CONFIG_BYTES, where=where)
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
            "kv_dtype": _kv_dtype(facts, graph),
            "kv_cache": "shared" if search.get("past_present_share_buffer") else "grow",
        },
        "tokenizer_file": "tokenizer.json",
        "chat_template_file": _CHAT_TEMPLATE if _is_regular(folder, _CHAT_TEMPLATE) else None,
        "bos_token": _token_text(tok.get("bos_token")),
        "eos_token": _token_text(tok.get("eos_token")),
        "eos_token_ids": eos_ids,
        "has_position_ids": has_positions,
        "source": {"kind": "onnxruntime-genai", "path": str(folder)},
        "quantization": {"method": "onnxruntime-genai"},
    }
    manifest = parse_manifest(data, where=where)
    manifest.check_files(folder, where=where)
    return manifest


def _check_tensor_names(decoder: dict[str, Any], where: str) -> None:
    for (side, key), expected in _NAMES.items():
        names = decoder.get(side, {})
        got = names.get(key, expected) if isinstance(names, dict) else None
        if got != expected:
            raise ModelLoadError(
                f"{where}: model.decoder.{side}.{key}={got!r:.80}; edgeinfer drives graphs "
                f"whose tensor is named {expected!r} (a decoder-only model with a KV cache)"
            )


def _graph_facts(path: Path, where: str) -> Any:
    from .onnx_graph import read_graph_facts  # standard library only

    if not os.path.lexists(path):
        raise ModelLoadError(f"{where}: model.decoder.filename names a missing file")
    return read_graph_facts(path)  # opened non-blocking, refused unless a regular file


def _kv_dtype(facts: Any, path: Path) -> str:
    """The cache's element type, read from the graph's first past input (fp16 graphs are
    built for GPUs)."""
    for name, elem in facts.input_types.items():
        if name.startswith("past_key_values."):
            if elem not in _KV_TYPES:
                raise ModelLoadError(
                    f"{path}: its KV cache has element type {elem}; edgeinfer drives float32 "
                    "and float16 caches"
                )
            return _KV_TYPES[elem]
    return "float32"


def _check_rotary_context(context: Any, facts: Any, filename: str, where: str) -> None:
    """A context longer than the graph's rotary cache loads, then fails at the first position
    past the cache: refused here, naming both numbers."""
    rows = facts.rotary_positions
    if type(context) is int and rows is not None and context > rows:
        raise ModelLoadError(
            f"{where}: model.context_length={context} is longer than the {rows} positions of "
            f"the rotary cache in {filename}; the config does not match its graph — set "
            f"model.context_length to at most {rows} or rebuild the folder"
        )


def _read_object(folder: Path, name: str, max_bytes: int, *, where: str) -> dict[str, Any]:
    """The JSON object in ``folder/name`` ({} when ``name`` is tokenizer_config.json and
    absent), read only once it is known to lie inside the folder."""
    path = resolve_inside(folder, name, name, where=where)
    if name == _TOKENIZER_CONFIG and not os.path.lexists(folder / name):
        return {}
    data = read_json_file(path, max_bytes=max_bytes, error=ModelLoadError)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{folder / name} must hold a JSON object")
    return data


def _is_regular(folder: Path, name: str) -> bool:
    """Whether the optional ``name`` is a regular file inside ``folder`` (a FIFO is not)."""
    path = resolve_inside(folder, name, name, where=str(folder))
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _mapping(data: dict[str, Any], key: str, where: str, prefix: str = "") -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{where}: {prefix}{key} must be a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
