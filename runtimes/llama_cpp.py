"""GGUF backend over llama.cpp's C API (through llama-cpp-python's ctypes bindings).

Our generator drives the loop: this module submits token batches with ``llama_decode`` and
hands back a view of the last position's logits. It never calls llama-cpp-python's
high-level ``Llama`` class.

Slots: a context of ``n_seq_max = parallel`` sequences, slot ``s`` being llama.cpp sequence id
``s``. The KV cache is split into one stream per sequence (``kv_unified`` off), each of
``n_ctx`` cells: a slot attends to its own cells only, so its cost and its numbers do not
depend on how long the other slots are, and a slot can never take another's room. Measured
(SmolLM2 Q4_1): a sequence's logits in any slot and any step are bit-identical to its logits
alone; with one unified cache and flash attention off they are not (greedy tokens change).
The price: llama.cpp runs one ubatch per run of consecutive sequence ids, so a step over
slots with gaps takes one forward pass per run (keep busy slots together). Filling the gaps
with throw-away tokens to make one pass was measured slower here (1 thread, busy machine:
402 ms against 346 ms for slots 0, 2, 4, 6): on CPU a row costs nearly what a pass does.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
from edgeinfer.files.gguf_checks import check_gguf_model
from edgeinfer.files.gguf_file import GGUFHeader
from edgeinfer.machine.busy import ThreadTuner
from edgeinfer.machine.policy import Candidate
from edgeinfer.memory.shape import gguf_shape

from .base import (
    TokenizerBase,
    aligned_chunks,
    check_fits,
    check_slot,
    is_marker,
    tokenizer_text,
)
from .llama_state import LlamaKVState

__all__ = ["LlamaCppBackend", "LlamaCppTokenizer", "engine", "engine_log_listener", "open_backend"]

logger = logging.getLogger(__name__)
_engine_log = logging.getLogger(__name__ + ".engine")

_MAX_BATCH = 512  # tokens per llama_decode call during prefill
# llama_token_attr bits (llama.h): a token's GGUF type as llama.cpp reads it
_ATTR_UNKNOWN = 1 << 0
_ATTR_UNUSED = 1 << 1
_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4


_log_listeners: list[Callable[[str], None]] = []


def _forward_engine_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", errors="replace").rstrip()
    if message:
        _engine_log.debug(message)
        for listener in list(_log_listeners):
            listener(message)


@contextmanager
def engine_log_listener(listener: Callable[[str], None]) -> Iterator[None]:
    """Also hand each llama.cpp log line to ``listener`` (for progress) within the block."""
    _log_listeners.append(listener)
    try:
        yield
    finally:
        _log_listeners.remove(listener)


def engine() -> Any:
    """The ``llama_cpp`` module, imported and initialised once (its log goes to the
    ``.engine`` logger); BackendUnavailableError when llama-cpp-python is not installed."""
    return _initialised()[0]


@functools.cache
def _initialised() -> tuple[Any, Any]:
    """Import llama.cpp, route its log and initialise its backend: once per process."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise BackendUnavailableError(
            "GGUF models need llama-cpp-python: pip install 'edgeinfer[gguf]'"
        ) from exc
    callback = llama_cpp.llama_log_callback(_forward_engine_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    return llama_cpp, callback  # the callback object must stay alive


def open_backend(
    path: Path, config: LoadConfig, header: GGUFHeader, candidate: Candidate
) -> LlamaCppBackend:
    check_gguf_model(header)  # llama.cpp aborts the process on some inconsistent files
    return LlamaCppBackend(path, config, header, candidate)


class LlamaCppTokenizer(TokenizerBase):
    """The vocabulary stored in the GGUF file, through llama.cpp's tokenizer."""

    def __init__(self, llama: Any, vocab: Any, header: GGUFHeader) -> None:
        self._llama = llama
        self._vocab = vocab
        super().__init__(
            n_vocab=int(llama.llama_vocab_n_tokens(vocab)),
            bos_token=self._special_text(llama.llama_vocab_bos(vocab)),
            eos_token=self._special_text(llama.llama_vocab_eos(vocab)),
            chat_template=header.metadata.get("tokenizer.chat_template"),
        )

    def _special_text(self, token_id: int) -> str | None:
        if token_id < 0:
            return None
        raw = self._llama.llama_vocab_get_text(self._live_vocab(), token_id)
        return raw.decode("utf-8", errors="replace") if raw else None

    def _live_vocab(self) -> Any:
        if self._vocab is None:
            raise EdgeInferError("the model is closed; load it again")
        return self._vocab

    def detach(self) -> None:
        """Called when the engine model is freed: later calls raise instead of crashing."""
        self._vocab = None

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        data = tokenizer_text(text).encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (self._llama.llama_token * capacity)()
            n = self._llama.llama_tokenize(
                self._live_vocab(), data, len(data), buf, capacity, add_special, parse_special
            )
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    def _piece(self, token_id: int) -> bytes:
        """The token's bytes under ``TOKEN_TEXT_RULE``, decided by its GGUF token type."""
        llama = self._llama
        attr = int(llama.llama_vocab_get_attr(self._live_vocab(), token_id))
        if attr & (_ATTR_CONTROL | _ATTR_UNKNOWN | _ATTR_UNUSED):
            return b""
        if attr & _ATTR_USER_DEFINED:
            raw = llama.llama_vocab_get_text(self._live_vocab(), token_id) or b""
            if is_marker(raw.decode("utf-8", errors="replace")):
                return b""
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._llama.llama_token_to_piece(self._live_vocab(), token_id, buf, size, 0, False)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def is_end_of_generation(self, token_id: int) -> bool:
        return bool(self._llama.llama_vocab_is_eog(self._live_vocab(), token_id))


class LlamaCppBackend:
    """One llama.cpp model and context holding ``n_slots`` sequences of up to n_ctx tokens."""

    multi_position_logits = True  # forward() returns every position's logits

    def __init__(
        self, path: Path, config: LoadConfig, header: GGUFHeader, candidate: Candidate
    ) -> None:
        llama = engine()
        self._llama = llama
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._n_slots = config.parallel
        self._past = [0] * self._n_slots  # tokens in each slot's cache
        self._logits_view: tuple[int, np.ndarray] | None = None
        self._rows_view: tuple[int, int, np.ndarray] | None = None
        self._unified = bool(candidate.options.get("kv_unified", False))
        n_gpu_layers = int(candidate.options.get("n_gpu_layers", 0))
        self._model = self._load_model(path, n_gpu_layers, candidate)
        try:
            self._n_ctx = config.context_for(int(llama.llama_model_n_ctx_train(self._model)))
            self._threads = config.resolved_threads
            # threads=None: re-measured between requests (machine/busy.py), set with
            # llama_set_n_threads
            self._tuner = ThreadTuner(self._threads) if config.threads is None else None
            self._flash_attention = config.flash_attention
            self._kv_dtype = "float32" if config.kv_dtype == "float32" else "float16"
            # Prefill is cut into chunks of the planned batch; a decode step carries one token
            # per slot, so the context takes at least n_slots tokens per llama_decode.
            self._chunk = min(self._n_ctx, config.batch_size or _MAX_BATCH)
            self._n_batch = max(self._chunk, self._n_slots)
            self._ctx = self._new_context()
            self._batch = llama.llama_batch_init(self._n_batch, 0, 1)
            self._memory = llama.llama_get_memory(self._ctx)
            self.tokenizer = LlamaCppTokenizer(
                llama, llama.llama_model_get_vocab(self._model), header
            )
            self._n_vocab = self.tokenizer.n_vocab
        except BaseException:
            self.close()
            raise
        per_token = gguf_shape(header, self._kv_dtype).kv_bytes_per_token
        self._kv_nbytes = per_token * self._n_ctx * self._n_slots
        self._info = {
            "backend": "llama.cpp",
            "engine_version": getattr(llama, "__version__", "unknown"),
            "provider": candidate.provider,
            "device": candidate.device,
            "n_gpu_layers": n_gpu_layers,
            "threads": self._threads,
            "threads_why": config.threads_why,
            "batch_size": self._chunk,
            "flash_attention": self._flash_attention,
            "parallel": self._n_slots,
            "kv_dtype": self._kv_dtype,
        }
        if self._n_slots > 1:
            self._info["kv_unified"] = self._unified
        logger.debug(
            "llama.cpp context ready: n_ctx=%d x %d slots, threads=%d",
            self._n_ctx,
            self._n_slots,
            self._threads,
        )

    def _load_model(self, path: Path, n_gpu_layers: int, candidate: Candidate) -> Any:
        provider = candidate.provider
        params = self._llama.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.main_gpu = int(candidate.options.get("main_gpu", 0))
        if "use_extra_bufts" in candidate.options:
            params.use_extra_bufts = bool(candidate.options["use_extra_bufts"])
        model = self._llama.llama_model_load_from_file(str(path).encode(), params)
        if not model and n_gpu_layers:
            raise BackendUnavailableError(
                f"{provider}: llama.cpp could not load {path.name} with its layers on the GPU "
                "(out of GPU memory, or a driver problem; run with --debug for the engine's log)"
            )
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {path}: unsupported architecture or corrupt tensors "
                "(run with --debug to see the engine's log)"
            )
        return model

    def _new_context(self) -> Any:
        params = self._llama.llama_context_default_params()
        # Not unified, llama.cpp gives each sequence n_ctx / n_seq_max cells.
        params.n_ctx = self._n_ctx * self._n_slots
        params.n_batch = self._n_batch
        params.n_ubatch = self._n_batch
        params.n_seq_max = self._n_slots
        params.kv_unified = self._unified
        params.n_threads = self._threads
        params.n_threads_batch = self._threads
        params.no_perf = True
        # Sliding-window layers (Gemma 3, ...) keep their whole cache, as the memory plan counts
        # it: a cache pruned to the window cannot be rewound exactly for prefix reuse.
        params.swa_full = True
        if self._kv_dtype == "float32":  # llama.cpp's default is F16
            params.type_k = params.type_v = self._llama.GGML_TYPE_F32
        params.flash_attn_type = (
            self._llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if self._flash_attention
            else self._llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        ctx = self._llama.llama_init_from_model(self._model, params)
        if not ctx:
            raise BackendUnavailableError(
                f"llama.cpp could not create a context of {self._n_slots} x {self._n_ctx} tokens "
                "(out of memory?); try a smaller context_length or parallel"
            )
        if self._llama.llama_n_ctx_seq(ctx) < self._n_ctx:
            self._llama.llama_free(ctx)
            raise BackendUnavailableError(
                f"llama.cpp gave each sequence fewer than {self._n_ctx} tokens of cache; "
                "try a smaller parallel"
            )
        return ctx

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_past(self) -> int:
        return self._past[0]

    @property
    def n_slots(self) -> int:
        return self._n_slots

    def slot_past(self, slot: int) -> int:
        return self._past[check_slot(slot, self._n_slots)]

    @property
    def reuse_is_exact(self) -> bool:
        """Whether a prompt read in two parts gives what it gives read whole. Measured: with
        flash attention off, bit-identical logits (tiny Llama and Gemma 3, SmolLM2 Q4_1); with
        it on, up to ~1.0 apart after a split (SmolLM2), enough to change greedy tokens.
        Shown on the CPU only: with layers offloaded to a GPU the claim is not made."""
        return not self._flash_attention and not self._info.get("n_gpu_layers")

    @property
    def kv_nbytes(self) -> int:
        return self._kv_nbytes

    def kv_state(self) -> LlamaKVState:
        """The slots' KV cache as bytes and back (``runtimes.base.KVState``)."""
        return LlamaKVState(self)

    @property
    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def prefill(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        past = self._past[check_slot(slot, self._n_slots)]
        self._retune()
        ids = check_fits(token_ids, past, self._n_ctx)
        chunks = aligned_chunks(ids, past, self._chunk)
        for i, chunk in enumerate(chunks):
            self._submit(chunk, slot, want_logits=i == len(chunks) - 1)
        return self._last_logits()

    def decode(self, token_id: int, slot: int = 0) -> np.ndarray:
        past = self._past[check_slot(slot, self._n_slots)]
        self._submit(check_fits([token_id], past, self._n_ctx), slot, want_logits=True)
        return self._last_logits()

    def forward(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        """Append ``token_ids`` in one pass; every position's logits [n, vocab] (a view)."""
        past = self._past[check_slot(slot, self._n_slots)]
        ids = check_fits(token_ids, past, self._n_ctx)
        if len(ids) > self._chunk:
            raise InvalidRequestError(f"forward reads {self._chunk} tokens at most, not {len(ids)}")
        self._submit(ids, slot, want_logits=True, every=True)
        return self._rows(len(ids))

    def rewind(self, n: int, slot: int = 0) -> None:
        past = self._past[check_slot(slot, self._n_slots)]
        if not 0 <= n <= past:
            raise InvalidRequestError(f"cannot rewind to {n!r}: slot {slot} holds {past}")
        self._require_open()
        # Remove positions [n, inf), not [n, past): after an interrupted decode the cache
        # may hold an entry past the count.
        self._llama.llama_memory_seq_rm(self._memory, slot, n, -1)
        self._past[slot] = n

    def decode_many(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        slots, tokens = self._check_steps(steps)
        self._require_open()
        # llama.cpp runs one ubatch per run of consecutive sequence ids in batch order (its
        # KV streams are split that way): rows go in slot order, so slots 0..k-1 take one
        # forward pass whatever order they are asked in, and each gap costs one more.
        order = sorted(range(len(slots)), key=slots.__getitem__)
        batch = self._batch
        batch.n_tokens = len(order)
        for row, i in enumerate(order):
            batch.token[row] = tokens[i]
            batch.pos[row] = self._past[slots[i]]
            batch.n_seq_id[row] = 1
            batch.seq_id[row][0] = slots[i]
            batch.logits[row] = 1
        self._run_batch(slots)
        for slot in slots:
            self._past[slot] += 1
        rows = self._rows(len(slots))  # [k, vocab], in slot order
        if order == list(range(len(order))):
            return rows
        return rows[np.argsort(order)]

    def _check_steps(self, steps: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """(slots, tokens) of ``steps`` if they name distinct slots that each have room."""
        try:
            pairs = [(slot, int(token)) for slot, token in steps]
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(
                "decode_many takes (slot, token id) pairs, one per slot"
            ) from exc
        if not pairs:
            raise InvalidRequestError("decode_many needs at least one (slot, token id) pair")
        slots = [check_slot(slot, self._n_slots) for slot, _ in pairs]
        if len(set(slots)) != len(slots):
            raise InvalidRequestError(f"decode_many names a slot twice: {slots}")
        for slot in slots:
            if self._past[slot] >= self._n_ctx:
                raise InvalidRequestError(
                    f"slot {slot} holds {self._n_ctx} tokens, its whole context; it is full"
                )
        return slots, [token for _, token in pairs]

    def _submit(self, ids: list[int], slot: int, *, want_logits: bool, every: bool = False) -> None:
        """``llama_decode`` ``ids`` into ``slot``, the last position's logits or every one's."""
        self._require_open()
        batch = self._batch
        n = len(ids)
        past = self._past[slot]
        batch.n_tokens = n
        for i, token in enumerate(ids):
            batch.token[i] = token
            batch.pos[i] = past + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot
            batch.logits[i] = 1 if every else 0
        batch.logits[n - 1] = 1 if want_logits or every else 0
        self._run_batch((slot,))
        self._past[slot] += n

    def _retune(self) -> None:
        """Between requests: follow the threads other processes leave free (machine/busy.py).
        Threads waiting at llama.cpp's barriers for one that another process holds off its
        core cost 2-3x the decode speed; one thread fewer on a free core costs ~1.5x."""
        tuner = self._tuner
        changed = tuner.check() if tuner is not None and self._ctx else None
        if changed is not None and tuner is not None and tuner.last is not None:
            self._llama.llama_set_n_threads(self._ctx, changed, changed)
            self._threads = self._info["threads"] = changed
            self._info["threads_why"] = tuner.last.why
            logger.debug("llama.cpp threads now %d (%s)", changed, tuner.last.why)

    def _run_batch(self, slots: Sequence[int]) -> None:
        """``llama_decode`` the filled batch; on failure, drop what it wrote to ``slots``."""
        rc = self._llama.llama_decode(self._ctx, self._batch)
        if rc != 0:
            for slot in slots:
                self._llama.llama_memory_seq_rm(self._memory, slot, self._past[slot], -1)
            raise BackendUnavailableError(f"llama.cpp failed to decode a batch (code {rc})")

    def _rows(self, k: int) -> np.ndarray:
        """The logits of the last batch's k outputs, in batch order: a view [k, vocab]."""
        ptr = self._llama.llama_get_logits(self._ctx)
        address = ctypes.cast(ptr, ctypes.c_void_p).value or 0
        if not address:
            raise BackendUnavailableError("llama.cpp returned no logits")
        if self._rows_view is None or self._rows_view[:2] != (address, k):
            view = np.ctypeslib.as_array(ptr, shape=(k, self._n_vocab))  # [k, vocab] float32
            view.flags.writeable = False
            self._rows_view = (address, k, view)
        return self._rows_view[2]

    def _last_logits(self) -> np.ndarray:
        ptr = self._llama.llama_get_logits_ith(self._ctx, -1)
        address = ctypes.cast(ptr, ctypes.c_void_p).value or 0
        if not address:
            raise BackendUnavailableError("llama.cpp returned no logits")
        if self._logits_view is None or self._logits_view[0] != address:
            view = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))  # [vocab] float32
            view.flags.writeable = False
            self._logits_view = (address, view)
        return self._logits_view[1]

    def _require_open(self) -> None:
        if self._ctx is None:
            raise EdgeInferError("the model is closed; load it again")

    def close(self) -> None:
        llama = self._llama
        if getattr(self, "tokenizer", None) is not None:
            self.tokenizer.detach()
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            llama.llama_model_free(self._model)
            self._model = None
        self._logits_view = None
        self._rows_view = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the bindings may already be gone
            pass
