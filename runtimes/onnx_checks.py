"""Load-time checks of an ONNX decoder graph against its manifest and the load's settings,
made before anything runs: a mismatch would otherwise surface at generation as an error
blaming the request. The ONNX backend (``onnxruntime.py``) calls them once per load."""

from __future__ import annotations

import re
from typing import Any

from edgeinfer.errors import ModelLoadError
from edgeinfer.files.manifest import MANIFEST_NAME, Architecture, Manifest

__all__ = [
    "LOGITS_TO_KEEP",
    "check_graph",
    "check_rotary",
    "check_shared_context",
    "check_slots",
    "fixed_batch",
    "past_names",
    "returns_last_position_only",
]

# An input of the native builder's graphs, int64 [1]: how many of each row's last positions
# get logits (1 for prefill and steps, k + 1 for a speculative verify pass).
LOGITS_TO_KEEP = "num_logits_to_keep"
_ORT_KV_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}
_PAST_KEY = re.compile(r"past_key_values\.\d+\.key")


def past_names(num_layers: int) -> list[str]:
    return [
        f"past_key_values.{layer}.{kind}"
        for layer in range(num_layers)
        for kind in ("key", "value")
    ]


def check_graph(session: Any, arch: Architecture) -> None:
    """The graph must take and return what the manifest says."""
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    _check_layer_count(inputs, arch)
    pasts = past_names(arch.num_layers)
    presents = [n.replace("past_key_values", "present") for n in pasts]
    missing = [n for n in ("input_ids", "attention_mask", *pasts) if n not in inputs]
    missing += [n for n in ("logits", *presents) if n not in outputs]
    if missing:
        raise ModelLoadError(
            f"the ONNX graph is not a decoder with a KV cache edgeinfer can drive: it lacks "
            f"{', '.join(missing[:4])}"
        )
    _check_int64_inputs(inputs)
    _check_static_dim(outputs["logits"], 2, "vocab_size", arch.vocab_size)
    for name in pasts:
        _check_kv_input(inputs[name], arch)


def check_slots(session: Any, n_slots: int, shared: bool) -> None:
    """``n_slots`` > 1 sequences need a graph with a batch axis on every input, the logits and
    the cache, and a cache written in place into one buffer (rows of the slots' buffer)."""
    if n_slots == 1:
        return
    if not shared:
        raise ModelLoadError(
            f"parallel={n_slots} needs a graph that writes its KV cache in place into one "
            "buffer; this folder's graph grows the cache each step (onnxruntime-genai's "
            "past_present_share_buffer is false) — load it with parallel=1, or use a folder "
            "converted by edgeinfer"
        )
    fixed = fixed_batch(session)
    if fixed:
        name, batch = fixed
        raise ModelLoadError(
            f"parallel={n_slots} needs a graph with a batch axis, but its {name} has a fixed "
            f"batch of {batch} (a graph built for one sequence at a time, as older edgeinfer "
            "releases built them) — re-convert the model (`edgeinfer convert`; a catalog "
            "model's transcode is rebuilt when its folder under $EDGEINFER_HOME/derived is "
            "deleted), or load it with parallel=1"
        )


def fixed_batch(session: Any) -> tuple[str, int] | None:
    """The first input or output whose batch axis the graph fixes, and its size; None when
    every one has a batch axis (the graph runs several rows in one step)."""
    inputs = [v for v in session.get_inputs() if v.name != LOGITS_TO_KEEP]  # one count for all
    for value in [*inputs, *session.get_outputs()]:
        batch = _batch_dim(value)
        if batch is not None:
            return value.name, batch
    return None


def _batch_dim(value: Any) -> int | None:
    """The first axis of ``value`` when the graph fixes it, None when it is symbolic."""
    shape = list(value.shape or [])
    if not shape or not isinstance(shape[0], int) or shape[0] <= 0:
        return None
    return int(shape[0])


def check_shared_context(n_ctx: int, arch: Architecture) -> None:
    if n_ctx > arch.max_context:
        raise ModelLoadError(
            f"context {n_ctx} is longer than the {arch.max_context} tokens this graph "
            "was built for; load it with a smaller context_length"
        )


def returns_last_position_only(session: Any) -> bool:
    """Graphs that return the last position only: every run's logits land in one buffer."""
    logits_dims = {o.name: o.shape for o in session.get_outputs()}["logits"]
    return len(logits_dims) == 3 and logits_dims[1] == 1


def check_rotary(rows: int | None, max_context: int, manifest: Manifest) -> None:
    """The model's context must fit the graph's rotary cache: past it, the graph fails at
    the first position beyond the cache, mid-reply."""
    if rows is None or max_context <= rows:
        return
    field = (
        "genai_config.json: model.context_length"
        if manifest.source.get("kind") == "onnxruntime-genai"
        else f"{MANIFEST_NAME}: architecture.max_context"
    )
    raise ModelLoadError(
        f"{field}={max_context} is longer than the {rows} positions of the ONNX graph's rotary "
        "cache; the config does not belong to this graph — re-convert the model"
    )


def _graph_error(field: str, value: Any, graph_says: str) -> ModelLoadError:
    return ModelLoadError(
        f"{MANIFEST_NAME}: architecture.{field}={value!r} disagrees with the ONNX graph, whose "
        f"{graph_says}; the manifest does not belong to this graph — re-convert the model"
    )


def _check_layer_count(inputs: dict[str, Any], arch: Architecture) -> None:
    layers = sum(1 for name in inputs if _PAST_KEY.fullmatch(name))
    if layers != arch.num_layers:
        raise _graph_error("num_layers", arch.num_layers, f"has {layers} past_key_values layers")


def _check_int64_inputs(inputs: dict[str, Any]) -> None:
    for name in ("input_ids", "attention_mask", "position_ids"):
        if name in inputs and inputs[name].type != "tensor(int64)":
            raise ModelLoadError(
                f"the ONNX graph's {name} is {inputs[name].type}; edgeinfer feeds tensor(int64)"
            )


def _check_static_dim(node: Any, axis: int, field: str, expected: int) -> None:
    """``node``'s dimension ``axis`` must equal ``expected`` where the graph fixes it."""
    shape = list(node.shape or [])
    if len(shape) <= axis:
        raise ModelLoadError(f"the ONNX graph's {node.name} has shape {shape}; expected more axes")
    dim = shape[axis]
    if isinstance(dim, int) and dim > 0 and dim != expected:
        raise _graph_error(field, expected, f"{node.name} has {dim} on axis {axis}")


def _check_kv_input(node: Any, arch: Architecture) -> None:
    # past_key_values.N.key/value: [batch, kv_heads, past, head_dim]
    if len(node.shape or []) != 4:
        raise ModelLoadError(
            f"the ONNX graph's {node.name} has shape {node.shape}; expected "
            "[batch, kv_heads, past, head_dim]"
        )
    _check_static_dim(node, 1, "num_kv_heads", arch.num_kv_heads)
    _check_static_dim(node, 3, "head_dim", arch.head_dim)
    graph_type = _ORT_KV_TYPES.get(node.type, node.type)
    if graph_type != arch.kv_dtype:
        raise _graph_error("kv_dtype", arch.kv_dtype, f"{node.name} is {node.type}")
