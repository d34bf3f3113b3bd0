"""ONNX backend over ONNX Runtime, for decoder graphs with a KV cache.

The graph takes ``input_ids`` [B, S], ``attention_mask`` [B, T], optionally ``position_ids``,
and ``past_key_values.N.key/value`` [B, kv_heads, past, head_dim]; it returns ``logits``
[B, S or 1, vocab] and ``present.N.key/value``. The cache never travels through numpy: a
shared cache (GroupQueryAttention writing in place) is one buffer per tensor with a row per
sequence slot, bound by address with IO binding (``onnx_slots``); a growing cache stays in
ONNX Runtime values carried from one step to the next. Only the last position's logits are
handed to the sampler. Graph checks at load live in ``onnx_checks``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.config import LoadConfig
from edgeinfer.errors import (
    BackendUnavailableError,
    EdgeInferError,
    InvalidRequestError,
    ModelLoadError,
)
from edgeinfer.files.catalog import edgeinfer_home
from edgeinfer.files.manifest import Manifest
from edgeinfer.machine.policy import CPU_PROVIDER, Candidate
from edgeinfer.memory.rss import release_free_heap

from .base import aligned_chunks, check_fits, check_slot
from .onnx_checks import (
    LOGITS_TO_KEEP,
    check_graph,
    check_rotary,
    check_shared_context,
    check_slots,
    fixed_batch,
    past_names,
    returns_last_position_only,
)
from .onnx_folder import model_path_of, open_tokenizer
from .onnx_slots import SlotCache, Step, plan_step
from .onnx_state import OnnxKVState

__all__ = ["OrtBackend", "open_backend"]

logger = logging.getLogger(__name__)

_PREFILL_CHUNK = 256  # tokens per run during prefill: bounds the [chunk, vocab] logits buffer
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
    """The graph and its KV cache, with ``config.parallel`` sequence slots (``SlotBackend``).

    A graph that shares its cache buffer (GroupQueryAttention writing in place) gets one
    allocation for every slot, a row per slot (``onnx_slots``). One-token runs keep their
    bindings from one step to the next while they stay in the same slot: a token then costs
    two bindings (the ids and the mask), as with a single sequence. A graph that grows its
    cache each step drives one sequence only.
    """

    def __init__(
        self, folder: Path, config: LoadConfig, manifest: Manifest, candidate: Candidate
    ) -> None:
        ort = _import_ort()
        self._ort = ort
        arch = manifest.architecture
        self._arch = arch
        self._threads = config.resolved_threads
        self._chunk = config.batch_size or _PREFILL_CHUNK
        model_path, facts = model_path_of(folder, manifest)
        check_rotary(facts.rotary_positions, arch.max_context, manifest)
        # the tokenizer first: what its parse frees goes back before the session grows on top
        self.tokenizer = open_tokenizer(folder, manifest)
        release_free_heap()
        self._session = self._open_session(model_path, candidate)
        release_free_heap()  # the graph's protobuf and what optimizing it freed
        self._n_ctx = config.context_for(arch.max_context)
        self._has_position_ids = any(i.name == "position_ids" for i in self._session.get_inputs())
        self._kv_type = np.float16 if arch.kv_dtype == "float16" else np.float32
        # one token's K and V in every layer: the one place the ONNX cache's size is computed
        itemsize = np.dtype(self._kv_type).itemsize
        self._kv_bytes_per_token = (
            2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * itemsize
        )
        self._past_names = past_names(arch.num_layers)
        self._present_names = [n.replace("past_key_values", "present") for n in self._past_names]
        check_graph(self._session, arch)
        self._shared = arch.kv_cache == "shared"
        self._n_slots = config.parallel
        check_slots(self._session, self._n_slots, self._shared)
        self._rows: int | None = None  # the cache's rows where lone steps are paired
        if self._shared:
            check_shared_context(self._n_ctx, arch)
        # graphs that take num_logits_to_keep (the native builder's) compute one position's
        # logits per row unless asked for more: runs bind 1, a verify pass k + 1
        inputs = {i.name for i in self._session.get_inputs()}
        self._counted = LOGITS_TO_KEEP in inputs
        self._last_only = self._counted or returns_last_position_only(self._session)
        self._binding = self._session.io_binding()
        # one logits row per slot: a one-token run (or a batched step) writes its rows here
        self._logits = np.empty((self._n_slots + 1, 1, arch.vocab_size), np.float32)
        # (first row, rows) the cache and logits are bound for; None: bound for nothing
        self._bound: tuple[int, int] | None = None
        self._cache = self._slot_cache() if self._shared else None
        self._past: list[Any] = []  # a growing cache's values (one slot)
        self._slot_past = [0] * self._n_slots
        self.rewind(0)
        self._info = {
            "backend": "onnxruntime",
            "engine_version": ort.__version__,
            "provider": candidate.provider,
            "device": candidate.device,
            "threads": self._threads,
            "threads_why": config.threads_why,
            "batch_size": self._chunk,
            "slots": self._n_slots,
            "quantization": manifest.quantization.get("method", "unknown"),
            "kv_dtype": arch.kv_dtype,
        }
        self._pair_lone_rows()

    def _pair_lone_rows(self) -> None:
        """Whether a lone sequence's step must carry a second row (``onnx_slots``), probed
        once at load on a small scratch cache of two rows. Where a one-row step computes as
        a row of a longer one does, bit for bit, it runs alone (a second row has a price:
        benchmarks/lone_steps.py); where it does not (onnxruntime's 4-bit kernels for one
        row differ on some CPUs), every lone step is paired with a neighbour slot's row, or
        at ``parallel=1`` with a spare row (one more context of KV cache than the memory
        plan counts, said in the log), so a reply does not depend on what runs beside it."""
        self._info["lone_steps"] = "one row"
        if not self._shared or fixed_batch(self._session):  # one row per run, always
            return
        if self._info["provider"] != "CPUExecutionProvider":  # the kernels probed are the CPU's
            return
        if self._probe_rows_differ():
            self._pair(True)
            if self._n_slots == 1:
                logger.info(
                    "a lone step runs paired with a spare KV row: %d MB beyond the plan",
                    self._kv_bytes_per_token * self._n_ctx // 10**6,
                )
            self._info["lone_steps"] = "paired"
        logger.debug("a lone sequence's step runs %s", self._info["lone_steps"])

    def _pair(self, on: bool) -> None:
        """Lone steps paired or not; at one slot pairing needs a spare row, so the cache,
        which must hold nothing then, is made again with one (also for tests and bench)."""
        self._rows, self._bound = (max(self._n_slots, 2) if on else None), None
        if on and self._cache is not None and len(self._cache.arrays[0]) < self._rows:
            if any(self._slot_past):
                raise EdgeInferError("the spare row is added to an empty cache only")
            self._cache = self._slot_cache()

    def _probe_rows_differ(self) -> bool:
        """A one-row step's logits against the same step paired, on a scratch cache."""
        arch, real, n_ctx = self._arch, self._cache, self._n_ctx
        scratch = (arch.num_kv_heads, 8, arch.head_dim)
        self._cache = SlotCache(self._past_names, 2, scratch, self._kv_type)
        self._n_ctx, probe, logits = 8, [1, 2, 3, 4], []
        try:
            for self._rows in (None, 2):
                self.rewind(0, 0)
                self._bound = None
                self.prefill(probe[:2], 0)
                logits.append([np.array(self.decode(t, 0)) for t in probe[2:]])
        finally:
            self._cache, self._n_ctx, self._rows, self._bound = real, n_ctx, None, None
            self.rewind(0, 0)
        return not all(np.array_equal(a, b) for a, b in zip(*logits, strict=True))

    def _slot_cache(self) -> SlotCache:
        """One buffer per cache tensor, every slot's whole context, allocated once."""
        arch = self._arch
        row = (arch.num_kv_heads, self._n_ctx, arch.head_dim)
        return SlotCache(self._past_names, max(self._rows or 0, self._n_slots), row, self._kv_type)

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

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_past(self) -> int:
        return self._slot_past[0]

    @property
    def n_slots(self) -> int:
        return self._n_slots

    def slot_past(self, slot: int) -> int:
        return self._slot_past[check_slot(slot, self._n_slots)]

    @property
    def reuse_is_exact(self) -> bool:
        """Shown on the CPU provider only (the default model's split reads agree bit for bit,
        tests/test_backend_conformance.py); other providers' kernels were never compared, so
        their prompt is read whole every time."""
        return bool(self._info.get("provider") == "CPUExecutionProvider")

    @property
    def multi_position_logits(self) -> bool:
        """``forward`` returns the logits of every position it reads; graphs that return the
        last position's only (and take no num_logits_to_keep) cannot."""
        return self._counted or not self._last_only

    @property
    def kv_nbytes(self) -> int:
        return self._kv_bytes_per_token * self._n_ctx * max(self._rows or 0, self._n_slots)

    def kv_state(self) -> OnnxKVState:
        """The slots' KV cache as bytes and back (``runtimes.base.KVState``)."""
        return OnnxKVState(self)

    @property
    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def prefill(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        check_slot(slot, self._n_slots)
        ids = check_fits(token_ids, self._slot_past[slot], self._n_ctx)
        logits: np.ndarray | None = None
        for chunk in aligned_chunks(ids, self._slot_past[slot], self._chunk):
            logits = self._run(chunk, slot)
        assert logits is not None
        return logits

    def decode(self, token_id: int, slot: int = 0) -> np.ndarray:
        check_slot(slot, self._n_slots)
        return self._run(check_fits([token_id], self._slot_past[slot], self._n_ctx), slot)

    def forward(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        """Append ``token_ids`` (at most one prefill chunk) in one run; the logits of every
        one of their positions, [len(token_ids), vocab] (a fresh array)."""
        check_slot(slot, self._n_slots)
        ids = check_fits(token_ids, self._slot_past[slot], self._n_ctx)
        if len(ids) > self._chunk:
            raise InvalidRequestError(
                f"forward takes at most {self._chunk} tokens in one run, not {len(ids)}"
            )
        if not self.multi_position_logits:
            raise InvalidRequestError(
                "this graph returns the last position's logits only; forward over several "
                "positions needs a graph with every position's logits (edgeinfer convert)"
            )
        if len(ids) == 1:
            return self._run(ids, slot)[None, :]
        return self._run(ids, slot, every=True)

    def decode_many(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        """One run over the rows of the listed slots (see ``onnx_slots``); [k, vocab]."""
        step = plan_step(steps, self._slot_past, self._n_ctx, self._logits.shape[2], self._rows)
        if len(step.lengths) == 1 and self._rows is None:  # a graph of one row per run
            (slot,) = step.lengths
            return self._run([int(step.ids[0, 0])], slot)[None, :]
        return self._step(step)

    def _step(self, step: Step) -> np.ndarray:
        """One run of a planned step over rows of the shared cache; [k, vocab]."""
        self._alive()
        assert self._cache is not None  # several rows: a shared cache (check_slots)
        n = step.ids.shape[0]
        if self._bound != (step.row, n):  # bindings stand while the rows stay the same
            self._bind_rows(step.row, n)
        saved = self._cache.save_first(step.saved_rows) if step.saved_rows else None
        try:
            positions = step.positions if self._has_position_ids else None
            self._execute(step.ids, step.mask, positions)
        finally:
            if saved is not None:
                self._cache.restore_first(step.saved_rows, saved)
        for slot, length in step.lengths.items():
            self._slot_past[slot] = length
        rows = self._logits[step.row : step.row + n, 0]
        return rows if step.order is None else rows[step.order]

    def _alive(self) -> None:
        if self._session is None:
            raise EdgeInferError("the model is closed; load it again")

    def _run(self, ids: list[int], slot: int, every: bool = False) -> np.ndarray:
        """One graph run over ``ids`` in ``slot``; returns the last position's logits [vocab]
        (``every``: all of them, [len(ids), vocab])."""
        if len(ids) == 1 and self._rows is not None and not every:  # never one row alone
            step = plan_step(
                [(slot, ids[0])], self._slot_past, self._n_ctx, self._logits.shape[2], self._rows
            )
            return self._step(step)[0]
        self._alive()
        n, past = len(ids), self._slot_past[slot]
        total = past + n
        one_buffer = (n == 1 or self._last_only) and not every
        if self._shared and one_buffer:
            if self._bound != (slot, 1):
                self._bind_rows(slot, 1)
        else:
            self._bound = None
            self._binding.clear_binding_inputs()
            self._binding.clear_binding_outputs()
            self._bind_cache_and_logits(one_buffer, slot)
        positions = None
        if self._has_position_ids:
            positions = np.arange(past, total, dtype=np.int64)[None, :]
        ids_ = np.array([ids], dtype=np.int64)
        self._execute(ids_, np.ones((1, total), np.int64), positions, n if every else 1)
        self._slot_past[slot] = total
        if self._shared and one_buffer:  # nothing bound was allocated by the run
            return self._logits[slot, -1]
        outputs = self._binding.get_outputs()  # logits first, then present.*
        if not self._shared:
            self._past = list(outputs[1:])  # present.* become the next step's past
        if one_buffer:
            return self._logits[0, -1]
        if every:
            return np.array(outputs[0].numpy()[0])
        # [vocab]: a copy of the last position's row, so the chunk's [chunk, vocab] block
        # (outputs[0]; numpy() is a view that keeps it alive) is freed before the next run
        return np.array(outputs[0].numpy()[0, -1])

    def _execute(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray | None, keep: int = 1
    ) -> None:
        """One run; ``keep``: the last positions whose logits a counting graph returns."""
        binding = self._binding
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        if self._counted:
            binding.bind_cpu_input(LOGITS_TO_KEEP, np.array([keep], dtype=np.int64))
        if positions is not None:
            binding.bind_cpu_input("position_ids", positions)
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime's own error types
            raise BackendUnavailableError(f"onnxruntime failed to run the model: {exc}") from exc

    def _bind_rows(self, row: int, n: int) -> None:
        """Rows ``row .. row + n - 1`` of the shared cache and of the logits buffer; they stay
        bound for the next run over the same rows."""
        assert self._cache is not None
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        self._cache.bind(binding, row, n)
        self._bind_logits(row, n)
        self._bound = (row, n)

    def _bind_logits(self, row: int, n: int) -> None:
        vocab = self._logits.shape[2]
        ptr = self._logits.ctypes.data + row * self._logits[0].nbytes
        self._binding.bind_output("logits", "cpu", 0, np.float32, [n, 1, vocab], ptr)

    def _bind_cache_and_logits(self, one_buffer: bool, slot: int) -> None:
        """Bindings of a run over several tokens whose logits are every position's, or of
        a growing cache (which the run replaces): logits first, then the cache."""
        binding = self._binding
        if one_buffer:  # logits land in one preallocated buffer
            self._bind_logits(slot, 1)
        else:
            binding.bind_output("logits", "cpu")
        if self._cache is not None:
            self._cache.bind(binding, slot, 1)
            return
        for name, value in zip(self._past_names, self._past, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name in self._present_names:
            binding.bind_output(name, "cpu")

    def rewind(self, n: int, slot: int = 0) -> None:
        past = self._slot_past[check_slot(slot, self._n_slots)]
        if not 0 <= n <= past:
            raise InvalidRequestError(f"cannot rewind to {n}: the cache holds {past}")
        a = self._arch
        if self._shared:  # entries past n are ignored (the mask's length) and overwritten
            self._slot_past[slot] = n
            return
        if n == 0:
            empty = np.zeros((1, a.num_kv_heads, 0, a.head_dim), dtype=self._kv_type)
            self._past = [self._ort.OrtValue.ortvalue_from_numpy(empty) for _ in self._past_names]
        elif n < past:  # the cache is cut on the sequence axis: [1, heads, n, dim]
            self._past = [
                self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :n]))
                for v in self._past
            ]
        self._slot_past[slot] = n

    def close(self) -> None:
        self._session = None
        self._binding = None
        self._bound = None
        self._cache = None
        self._past = []
