"""The embedding backend: an encoder graph (``converters/onnx/encoder.py``) on ONNX Runtime,
with the folder's tokenizer.json. It tokenizes a batch (truncated at the model's maximum
length, padded on the right to the longest text), runs the graph and returns the last hidden
states; pooling and normalizing are ``edgeinfer.embedding.batches``'s.

It is a ``Backend`` for the facts ``Model`` reads (tokenizer, info, context, close) and has no
generation steps: ``kind = "embedding"``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import BackendUnavailableError, ModelLoadError

from .base import cut_keeping_last, tokenizer_text
from .tokenizer_json import JsonTokenizer

__all__ = ["EncoderBackend", "open_backend"]

logger = logging.getLogger(__name__)


def open_backend(path: Path, config: Any, encoder: Any, candidate: Any) -> EncoderBackend:
    """The registry's opener: ``encoder`` is the source's header, an ``EncoderModel``."""
    return EncoderBackend(encoder, config, candidate)


class EncoderBackend:
    """One ONNX Runtime session over an encoder graph, and its tokenizers."""

    kind = "embedding"
    n_slots = 1
    kv_nbytes = 0

    def __init__(self, encoder: Any, config: Any, candidate: Any) -> None:
        """``encoder``: an ``EncoderModel`` (``edgeinfer.embedding.load``): the checked
        folder and its built graph; ``config`` a ``LoadConfig``; ``candidate`` the provider."""
        try:
            import onnxruntime as ort
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise BackendUnavailableError(
                "embedding models need onnxruntime and tokenizers: pip install 'edgeinfer[onnx]'"
            ) from exc
        folder = encoder.folder
        self._folder = folder
        self._max_len = folder.max_seq_length
        self.tokenizer = JsonTokenizer(
            folder.tokenizer, eos_token_ids=(), bos_token=None, eos_token=None, chat_template=None
        )
        try:
            self._batch_tok = Tokenizer.from_file(str(folder.tokenizer))
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise ModelLoadError(f"cannot read the tokenizer {folder.tokenizer}: {exc}") from exc
        self._batch_tok.no_padding()
        self._batch_tok.no_truncation()  # lengths before truncation are measured, then cut
        self._lock = threading.Lock()  # one batch at a time
        self._threads = max(1, config.resolved_threads)
        # Threads split a batch's rows, each part one single-threaded run of the same session
        # (onnxruntime runs them concurrently): no barrier per operator between threads, so
        # a thread the OS takes away delays only its part; measured faster than the
        # operator-level threads on short texts, more so on a busy machine
        # (benchmarks/embeddings.py). Each part is cut to its own longest text.
        self._pool = ThreadPoolExecutor(self._threads) if self._threads > 1 else None
        self._session = _session(ort, encoder.graph, 1, candidate)
        self._info = {
            "backend": "onnxruntime",
            "kind": "embedding",
            "provider": self._session.get_providers()[0],
            "device": candidate.device,
            "threads": config.resolved_threads,
            "embedding_dim": folder.dim,
            "pooling": folder.pooling,
            "normalize": folder.normalize,
            "max_seq_length": folder.max_seq_length,
            "graph": str(encoder.graph),
        }

    @property
    def info(self) -> dict[str, Any]:
        return dict(self._info)

    @property
    def n_ctx(self) -> int:
        return self._max_len

    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        """Each text's token ids cut to the model's maximum length (its last token, [SEP],
        kept), and each text's token count before the cut."""
        encodings = self._batch_tok.encode_batch([tokenizer_text(t) for t in texts])
        full = [e.ids for e in encodings]
        return cut_keeping_last(full, self._max_len), [len(ids) for ids in full]

    def hidden_states(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The last hidden state float32 [B, S, H] of ids and mask int32 [B, S] (right
        padding; rows past a text's length are zeros)."""
        with self._lock:
            session = self._session
            if session is None:
                raise ModelLoadError("the model is closed; load it again")
            parts = np.array_split(np.arange(ids.shape[0]), min(self._threads, ids.shape[0]))

            def run(rows: np.ndarray) -> np.ndarray:
                width = max(1, int(mask[rows].sum(1).max()))
                feeds = {"input_ids": ids[rows, :width], "attention_mask": mask[rows, :width]}
                return np.asarray(session.run(None, feeds)[0])

            outs = (
                list(self._pool.map(run, parts))
                if self._pool and len(parts) > 1
                else [run(parts[0])]
            )
        hidden = np.zeros((*ids.shape, outs[0].shape[-1]), np.float32)
        for rows, out in zip(parts, outs, strict=True):
            hidden[rows, : out.shape[1]] = out
        return hidden

    def close(self) -> None:
        with self._lock:
            self._session = None
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def _session(ort: Any, graph: Path, threads: int, candidate: Any) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 1 if logger.isEnabledFor(logging.DEBUG) else 3
    providers: list[Any] = [(candidate.provider, dict(candidate.options))]
    if candidate.provider != "CPUExecutionProvider":
        providers.append("CPUExecutionProvider")
    try:
        return ort.InferenceSession(str(graph), options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelLoadError(f"onnxruntime could not load {graph}: {exc}") from exc
