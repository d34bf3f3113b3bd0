"""ONNX backend over ONNX Runtime, for decoder graphs with a KV cache.

The graph takes ``input_ids``, ``attention_mask``, optionally ``position_ids``, and
``past_key_values.N.key/value`` [1, kv_heads, past, head_dim]; it returns ``logits``
[1, seq, vocab] and ``present.N.key/value`` [1, kv_heads, past + seq, head_dim]. The cache stays
in ONNX Runtime values bound with IO binding from one step to the next, so it never travels
through numpy; only the last position's logits are handed to the sampler.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.catalog import edgeinfer_home
from edgeinfer.config import LoadConfig
from edgeinfer.errors import (
    BackendUnavailableError,
    EdgeInferError,
    InvalidRequestError,
    ModelLoadError,
)
from edgeinfer.manifest import Manifest
from edgeinfer.policy import CPU_PROVIDER, Candidate

from .base import check_fits
from .tokenizer_json import JsonTokenizer

__all__ = ["OrtBackend", "open_backend"]

logger = logging.getLogger(__name__)

_PREFILL_CHUNK = 256  # tokens per run during prefill: bounds the [chunk, vocab] logits buffer
_KV_BYTES = {"float32": 4, "float16": 2}
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
        self._session = self._open_session(folder / manifest.model_file, candidate)
        self._n_ctx = config.context_for(arch.max_context)
        self._has_position_ids = any(i.name == "position_ids" for i in self._session.get_inputs())
        self._kv_type = np.float16 if arch.kv_dtype == "float16" else np.float32
        self._past_names = [
            f"past_key_values.{layer}.{kind}"
            for layer in range(arch.num_layers)
            for kind in ("key", "value")
        ]
        self._present_names = [n.replace("past_key_values", "present") for n in self._past_names]
        self._check_graph()
        self._binding = self._session.io_binding()
        self._decode_logits = np.empty((1, 1, arch.vocab_size), dtype=np.float32)
        self._past: list[Any] = []
        self._n_past = 0
        self.rewind(0)
        self.tokenizer = JsonTokenizer(
            folder / manifest.tokenizer_file,
            eos_token_ids=manifest.eos_token_ids,
            bos_token=manifest.bos_token,
            eos_token=manifest.eos_token,
            chat_template=_read_optional(folder, manifest.chat_template_file),
            n_vocab=arch.vocab_size,
        )
        self._info = {
            "backend": "onnxruntime",
            "engine_version": ort.__version__,
            "provider": candidate.provider,
            "device": candidate.device,
            "threads": self._threads,
            "batch_size": self._chunk,
            "quantization": manifest.quantization.get("method", "unknown"),
        }

    def _open_session(self, path: Path, candidate: Candidate) -> Any:
        ort = self._ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
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
        inputs = {i.name for i in self._session.get_inputs()}
        outputs = {o.name for o in self._session.get_outputs()}
        missing = [n for n in ("input_ids", "attention_mask", *self._past_names) if n not in inputs]
        missing += [n for n in ("logits", *self._present_names) if n not in outputs]
        if missing:
            raise ModelLoadError(
                f"the ONNX graph is not a decoder with a KV cache edgeinfer can drive: it lacks "
                f"{', '.join(missing[:4])}"
            )

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_past(self) -> int:
        return self._n_past

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
        for start in range(0, len(ids), self._chunk):
            logits = self._run(ids[start : start + self._chunk])
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
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input("input_ids", np.array([ids], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, total), dtype=np.int64))
        if self._has_position_ids:
            positions = np.arange(self._n_past, total, dtype=np.int64)[None, :]
            binding.bind_cpu_input("position_ids", positions)
        for name, value in zip(self._past_names, self._past, strict=True):
            binding.bind_ortvalue_input(name, value)
        if n == 1:  # decode: logits land in one preallocated buffer, no allocation per token
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
        for name in self._present_names:
            binding.bind_output(name, "cpu")
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime's own error types
            raise BackendUnavailableError(f"onnxruntime failed to run the model: {exc}") from exc
        outputs = binding.get_outputs()
        self._past = list(outputs[1:])  # present.* become the next step's past
        self._n_past = total
        if n == 1:
            return self._decode_logits[0, 0]
        return outputs[0].numpy()[0, -1]  # [vocab]: the last position only

    def rewind(self, n: int) -> None:
        if not 0 <= n <= self._n_past:
            raise InvalidRequestError(f"cannot rewind to {n}: the cache holds {self._n_past}")
        a = self._arch
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


def _read_optional(folder: Path, name: str | None) -> str | None:
    if not name or not (folder / name).is_file():
        return None
    return (folder / name).read_text(encoding="utf-8")
