"""ONNX backend over ONNX Runtime, for decoder graphs with a KV cache.

The graph takes ``input_ids``, ``attention_mask``, optionally ``position_ids``, and
``past_key_values.N.key/value`` [1, kv_heads, past, head_dim]; it returns ``logits``
[1, seq, vocab] and ``present.N.key/value`` [1, kv_heads, past + seq, head_dim]. The cache stays
in ONNX Runtime values bound with IO binding from one step to the next, so it never travels
through numpy; only the last position's logits are handed to the sampler.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.bounded_json import read_regular_file
from edgeinfer.catalog import edgeinfer_home
from edgeinfer.config import LoadConfig
from edgeinfer.errors import (
    BackendUnavailableError,
    EdgeInferError,
    InvalidRequestError,
    ModelLoadError,
)
from edgeinfer.manifest import MANIFEST_NAME, Architecture, Manifest, resolve_inside
from edgeinfer.policy import CPU_PROVIDER, Candidate

from .base import aligned_chunks, check_fits
from .onnx_external import GraphFacts, read_graph_facts
from .tokenizer_json import JsonTokenizer

__all__ = ["OrtBackend", "open_backend"]

logger = logging.getLogger(__name__)

_PREFILL_CHUNK = 256  # tokens per run during prefill: bounds the [chunk, vocab] logits buffer
_KV_BYTES = {"float32": 4, "float16": 2}
_ORT_KV_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}
_PAST_KEY = re.compile(r"past_key_values\.\d+\.key")
_MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few KB
_DML = "DmlExecutionProvider"
_TRT = "TensorrtExecutionProvider"


def _import_ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailableError(
            "ONNX models need onnxruntime: pip install 'edgeinfer[onnx]'"
        ) from exc
    return onnxruntime


def open_backend(
    folder: Path, config: LoadConfig, manifest: Manifest, candidate: Candidate
) -> OrtBackend:
    return OrtBackend(folder, config, manifest, candidate)


class OrtBackend:
    def __init__(
        self, folder: Path, config: LoadConfig, manifest: Manifest, candidate: Candidate
    ) -> None:
        ort = _import_ort()
        self._ort = ort
        arch = manifest.architecture
        self._arch = arch
        self._threads = config.resolved_threads
        self._chunk = config.batch_size or _PREFILL_CHUNK
        model_path, facts = _model_path(folder, manifest)
        _check_rotary(facts.rotary_positions, arch.max_context, manifest)
        self._session = self._open_session(model_path, candidate)
        self._n_ctx = config.context_for(arch.max_context)
        self._has_position_ids = any(i.name == "position_ids" for i in self._session.get_inputs())
        self._kv_type = np.float16 if arch.kv_dtype == "float16" else np.float32
        self._past_names = _past_names(arch.num_layers)
        self._present_names = [n.replace("past_key_values", "present") for n in self._past_names]
        self._check_graph()
        self._shared = arch.kv_cache == "shared"
        if self._shared:
            _check_shared_context(self._n_ctx, arch)
        self._last_only = _returns_last_position_only(self._session)
        self._binding = self._session.io_binding()
        self._decode_logits = np.empty((1, 1, arch.vocab_size), dtype=np.float32)
        # shared cache and one logits buffer: everything but the ids and the mask is bound
        # once and stays bound (decoding then costs two bindings per token, not 2 + 2 * layers)
        self._static_bound = False
        self._past: list[Any] = self._whole_context_cache() if self._shared else []
        self._n_past = 0
        self.rewind(0)
        self.tokenizer = _open_tokenizer(folder, manifest)
        self._info = {
            "backend": "onnxruntime",
            "engine_version": ort.__version__,
            "provider": candidate.provider,
            "device": candidate.device,
            "threads": self._threads,
            "batch_size": self._chunk,
            "quantization": manifest.quantization.get("method", "unknown"),
        }

    def _whole_context_cache(self) -> list[Any]:
        """One buffer per cache tensor, the whole context, allocated once."""
        arch = self._arch
        whole = (1, arch.num_kv_heads, self._n_ctx, arch.head_dim)
        make = self._ort.OrtValue.ortvalue_from_shape_and_type
        return [make(whole, self._kv_type) for _ in self._past_names]

    def _open_session(self, path: Path, candidate: Candidate) -> Any:
        ort = self._ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Keep the CPU arena (the default), which the memory plan was measured with: without
        # it each step's grown KV cache goes through malloc/free and the peak more than
        # doubled (0.70 -> 1.6-1.7 GB at a 1024-token context).
        options.enable_cpu_mem_arena = True
        # onnxruntime's own log (stderr) only when edgeinfer's is at DEBUG: --debug.
        options.log_severity_level = 1 if logger.isEnabledFor(logging.DEBUG) else 3
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing; the model folder is incomplete")
        provider = candidate.provider
        provider_options = dict(candidate.options)
        if provider == _DML:
            options.enable_mem_pattern = False  # DirectML requires it off
        if provider == _TRT and "trt_engine_cache_path" not in provider_options:
            cache = edgeinfer_home() / "cache" / "tensorrt"
            try:
                cache.mkdir(parents=True, exist_ok=True)
                provider_options["trt_engine_cache_path"] = str(cache)
            except OSError as exc:  # no cache: TensorRT rebuilds its engine on every load
                logger.warning("TensorRT engine cache disabled: cannot create %s: %s", cache, exc)
                provider_options["trt_engine_cache_enable"] = False
        providers: list[Any] = [(provider, provider_options)]
        if provider != CPU_PROVIDER:
            providers.append(CPU_PROVIDER)  # for the nodes the accelerator does not take
        try:
            session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types (Fail, ...)
            if provider != CPU_PROVIDER:
                raise BackendUnavailableError(
                    f"{provider} could not create a session for {path.name}: {exc}"
                ) from exc
            raise ModelLoadError(f"onnxruntime could not load {path}: {exc}") from exc
        enabled = session.get_providers()
        if enabled[0] != provider:
            # onnxruntime drops a provider whose libraries fail to load and runs on the CPU
            # with only a warning; report it so the plan's next candidate is tried instead.
            raise BackendUnavailableError(
                f"onnxruntime did not enable {provider} (enabled: {', '.join(enabled)}); its "
                "libraries or drivers failed to load — run with --debug for onnxruntime's log"
            )
        return session

    def _check_graph(self) -> None:
        """The graph must take and return what the manifest says, before anything runs: a
        mismatch would otherwise surface at generation as an error blaming the request."""
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        _check_layer_count(inputs, self._arch)
        missing = [n for n in ("input_ids", "attention_mask", *self._past_names) if n not in inputs]
        missing += [n for n in ("logits", *self._present_names) if n not in outputs]
        if missing:
            raise ModelLoadError(
                f"the ONNX graph is not a decoder with a KV cache edgeinfer can drive: it lacks "
                f"{', '.join(missing[:4])}"
            )
        _check_int64_inputs(inputs)
        _check_static_dim(outputs["logits"], 2, "vocab_size", self._arch.vocab_size)
        for name in self._past_names:
            _check_kv_input(inputs[name], self._arch)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_past(self) -> int:
        return self._n_past

    @property
    def reuse_is_exact(self) -> bool:
        return True  # the default model's split reads agree (tests/test_backend_conformance.py)

    @property
    def kv_nbytes(self) -> int:
        a = self._arch
        return (
            2
            * a.num_layers
            * a.num_kv_heads
            * a.head_dim
            * self._n_ctx
            * _KV_BYTES.get(a.kv_dtype, 4)
        )

    @property
    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = check_fits(token_ids, self._n_past, self._n_ctx)
        logits: np.ndarray | None = None
        for chunk in aligned_chunks(ids, self._n_past, self._chunk):
            logits = self._run(chunk)
        assert logits is not None
        return logits

    def decode(self, token_id: int) -> np.ndarray:
        return self._run(check_fits([token_id], self._n_past, self._n_ctx))

    def _run(self, ids: list[int]) -> np.ndarray:
        """One graph run over ``ids``; returns the last position's logits [vocab]."""
        if self._session is None:
            raise EdgeInferError("the model is closed; load it again")
        binding, n = self._binding, len(ids)
        total = self._n_past + n
        one_buffer = n == 1 or self._last_only
        if self._shared and one_buffer:
            self._bind_static()
        else:
            self._static_bound = False
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            self._bind_cache_and_logits(one_buffer)
        binding.bind_cpu_input("input_ids", np.array([ids], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, total), dtype=np.int64))
        if self._has_position_ids:
            positions = np.arange(self._n_past, total, dtype=np.int64)[None, :]
            binding.bind_cpu_input("position_ids", positions)
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime's own error types
            raise BackendUnavailableError(f"onnxruntime failed to run the model: {exc}") from exc
        self._n_past = total
        if self._shared and one_buffer:  # nothing bound was allocated by the run
            return self._decode_logits[0, -1]
        outputs = binding.get_outputs()  # logits first, then present.*
        if not self._shared:
            self._past = list(outputs[1:])  # present.* become the next step's past
        if one_buffer:
            return self._decode_logits[0, -1]
        return outputs[0].numpy()[0, -1]  # [vocab]: the last position only

    def _bind_static(self) -> None:
        if not self._static_bound:
            self._binding.clear_binding_inputs()
            self._binding.clear_binding_outputs()
            self._bind_cache_and_logits(True)
            self._static_bound = True

    def _bind_cache_and_logits(self, one_buffer: bool) -> None:
        binding = self._binding
        for name, value in zip(self._past_names, self._past, strict=True):
            binding.bind_ortvalue_input(name, value)
        if one_buffer:  # logits land in one preallocated buffer
            binding.bind_output(
                "logits",
                "cpu",
                0,
                np.float32,
                list(self._decode_logits.shape),
                self._decode_logits.ctypes.data,
            )
        else:
            binding.bind_output("logits", "cpu")
        if self._shared:  # the graph writes the new entries into the same buffers
            for name, value in zip(self._present_names, self._past, strict=True):
                binding.bind_ortvalue_output(name, value)
        else:
            for name in self._present_names:
                binding.bind_output(name, "cpu")

    def rewind(self, n: int) -> None:
        if not 0 <= n <= self._n_past:
            raise InvalidRequestError(f"cannot rewind to {n}: the cache holds {self._n_past}")
        a = self._arch
        if self._shared:  # entries past n are ignored (the mask's length) and overwritten
            self._n_past = n
            return
        if n == 0:
            empty = np.zeros((1, a.num_kv_heads, 0, a.head_dim), dtype=self._kv_type)
            self._past = [self._ort.OrtValue.ortvalue_from_numpy(empty) for _ in self._past_names]
        elif n < self._n_past:  # the cache is cut on the sequence axis: [1, heads, n, dim]
            self._past = [
                self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :n]))
                for v in self._past
            ]
        self._n_past = n

    def close(self) -> None:
        self._session = None
        self._binding = None
        self._past = []


def _past_names(num_layers: int) -> list[str]:
    return [
        f"past_key_values.{layer}.{kind}"
        for layer in range(num_layers)
        for kind in ("key", "value")
    ]


def _check_shared_context(n_ctx: int, arch: Architecture) -> None:
    if n_ctx > arch.max_context:
        raise ModelLoadError(
            f"context {n_ctx} is longer than the {arch.max_context} tokens this graph "
            "was built for; load it with a smaller context_length"
        )


def _returns_last_position_only(session: Any) -> bool:
    """Graphs that return the last position only: every run's logits land in one buffer."""
    logits_dims = {o.name: o.shape for o in session.get_outputs()}["logits"]
    return len(logits_dims) == 3 and logits_dims[1] == 1


def _open_tokenizer(folder: Path, manifest: Manifest) -> JsonTokenizer:
    arch = manifest.architecture
    tokenizer = JsonTokenizer(
        _regular_file(folder, manifest.tokenizer_file, "tokenizer_file"),
        eos_token_ids=manifest.eos_token_ids,
        bos_token=manifest.bos_token,
        eos_token=manifest.eos_token,
        chat_template=_read_optional(folder, manifest.chat_template_file),
        n_vocab=arch.vocab_size,
    )
    _check_tokenizer_size(tokenizer, folder / manifest.tokenizer_file, arch)
    return tokenizer


def _model_path(folder: Path, manifest: Manifest) -> tuple[Path, GraphFacts]:
    """The graph's real path and facts, once it and every external data file it names are
    known to lie inside ``folder`` (onnxruntime before 1.24 follows ``../`` in external data
    locations)."""
    path = _regular_file(folder, manifest.model_file, "model_file")
    base = path.parent.relative_to(folder.resolve())
    facts = read_graph_facts(path)
    for location in facts.locations:
        name = (base / location).as_posix()
        data = resolve_inside(folder, name, "external data location", where=str(path))
        if not data.is_file():
            raise ModelLoadError(
                f"{path}: its external data file {location!r} is missing or not a regular "
                "file; the model folder is incomplete"
            )
    return path, facts


def _check_rotary(rows: int | None, max_context: int, manifest: Manifest) -> None:
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


def _regular_file(folder: Path, name: str, key: str) -> Path:
    """The real path of a file the manifest names; it must be a regular file in ``folder``
    (not a FIFO, which would block the load forever)."""
    path = resolve_inside(folder, name, key)
    if not path.is_file():
        raise ModelLoadError(
            f"{MANIFEST_NAME}: {key}={name!r} is missing or not a regular file; the model "
            "folder is incomplete"
        )
    return path


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


def _check_tokenizer_size(tokenizer: JsonTokenizer, path: Path, arch: Architecture) -> None:
    """Every id the tokenizer can produce must have a row in the graph's logits."""
    size = tokenizer.size
    if size > arch.vocab_size:
        raise ModelLoadError(
            f"{MANIFEST_NAME}: architecture.vocab_size={arch.vocab_size} is smaller than the "
            f"tokenizer {path.name} ({size} ids); the manifest or tokenizer does not belong to "
            "this model — re-convert it"
        )


def _read_optional(folder: Path, name: str | None) -> str | None:
    """The chat template's text; None when the manifest names none or the file is absent."""
    if name is None:
        return None
    path = resolve_inside(folder, name, "chat_template_file")
    if not path.is_file():
        return None
    try:
        data = read_regular_file(path, max_bytes=_MAX_TEMPLATE_BYTES, error=ModelLoadError)
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(
            f"{MANIFEST_NAME}: chat_template_file={name!r} is not UTF-8 text: {exc}"
        ) from exc
    except ModelLoadError as exc:  # replaced by a FIFO or grown since the check: named
        raise ModelLoadError(f"{MANIFEST_NAME}: chat_template_file={name!r}: {exc}") from exc
