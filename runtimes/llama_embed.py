"""The GGUF embedding backend: an encoder GGUF (BERT) in llama.cpp's embedding mode, pooled by
llama.cpp as the file's ``<arch>.pooling_type`` says. Texts are tokenized by the file's own
vocabulary, cut at the model's maximum length (the last token, [SEP], kept, as the ONNX
encoder route does) and packed into decodes of at most one maximum-length text's worth of
tokens, one sequence each, so llama.cpp's compute stays within what the memory plan counted.

It is a ``Backend`` for the facts ``Model`` reads (tokenizer, info, context, close) and has no
generation steps: ``kind = "embedding"``; ``pooled`` gives each text's pooled vector.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import ModelLoadError

from .base import cut_keeping_last
from .llama_cpp import LlamaCppTokenizer, engine

__all__ = ["LlamaEmbedBackend"]


class LlamaEmbedBackend:
    """One llama.cpp model and embedding context over an encoder GGUF."""

    kind = "embedding"
    n_slots = 1
    kv_nbytes = 0

    def __init__(self, path: Path, encoder: Any, threads: int) -> None:
        """``encoder``: the checked ``GGUFEncoder`` (``edgeinfer.embedding.gguf``)."""
        llama_cpp = engine()
        from llama_cpp import Llama

        self._max_len = encoder.max_seq_length
        self._dim = encoder.config.hidden_size
        try:
            self._llm = Llama(
                str(path), embedding=True, pooling_type=encoder.pooling_code, n_gpu_layers=0,
                n_ctx=self._max_len, n_batch=self._max_len, n_ubatch=self._max_len,
                n_threads=threads, n_threads_batch=threads, verbose=False,
            )  # fmt: skip
        except ValueError as exc:  # llama-cpp-python's "Failed to load model"
            raise ModelLoadError(f"llama.cpp could not open {path} as an embedding model") from exc
        self._llama = llama_cpp
        self.tokenizer = LlamaCppTokenizer(llama_cpp, self._llm._model.vocab, encoder.header)
        self._lock = threading.Lock()  # one batch at a time
        self._info = {
            "backend": "llama.cpp",
            "kind": "embedding",
            "provider": "llama.cpp CPU",
            "device": "cpu",
            "threads": threads,
            "embedding_dim": self._dim,
            "pooling": encoder.pooling,
            "normalize": False,
            "max_seq_length": self._max_len,
        }

    @property
    def info(self) -> dict[str, Any]:
        return dict(self._info)

    @property
    def n_ctx(self) -> int:
        return self._max_len

    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        """Each text's token ids cut to the maximum length (its last token kept), and each
        text's token count before the cut."""
        full = [self.tokenizer.encode(t, add_special=True, parse_special=False) for t in texts]
        return cut_keeping_last(full, self._max_len), [len(ids) for ids in full]

    def pooled(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """The pooled vectors float32 [n, dim] of ``seqs`` (token ids, each <= n_ctx)."""
        out = np.empty((len(seqs), self._dim), np.float32)
        group: list[int] = []
        used = 0
        if self._llm is None:
            raise ModelLoadError("the model is closed; load it again")
        seq_max = int(self._llm.context_params.n_seq_max)
        out[[i for i, ids in enumerate(seqs) if not ids]] = 0.0  # nothing to read
        with self._lock:
            for i, ids in enumerate(seqs):
                if not ids:
                    continue
                if group and (used + len(ids) > self._max_len or len(group) >= seq_max):
                    self._decode(seqs, group, out)
                    group, used = [], 0
                group.append(i)
                used += len(ids)
            if group:
                self._decode(seqs, group, out)
        return out

    def _decode(self, seqs: Sequence[Sequence[int]], group: list[int], out: np.ndarray) -> None:
        llm = self._llm
        if llm is None:
            raise ModelLoadError("the model is closed; load it again")
        # llama-cpp-python's own embed() tokenizes text itself; this is its decode step
        # over token ids we cut ourselves
        batch = llm._batch
        batch.reset()
        for seq, i in enumerate(group):
            batch.add_sequence(list(seqs[i]), seq, True)
        llm._ctx.kv_cache_clear()
        llm._ctx.decode(batch)
        for seq, i in enumerate(group):
            ptr = self._llama.llama_get_embeddings_seq(llm._ctx.ctx, seq)
            out[i] = np.ctypeslib.as_array(ptr, shape=(self._dim,))
        batch.reset()

    def close(self) -> None:
        with self._lock:
            if self._llm is not None:
                self.tokenizer.detach()
                self._llm.close()
                self._llm = None  # type: ignore[assignment]
