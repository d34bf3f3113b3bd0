"""Embeddings: texts checked where they enter, tokenized, run in batches of similar length
through an embedding backend, pooled as the model's own configuration says (mean, CLS, last
token, max) and L2-normalized on request.

``embed_texts`` returns the vectors with what each text cost (tokens) and whether it was
truncated at the model's maximum length; ``Model.embed`` returns the vectors and logs the
truncation, the CLI and the server report it per text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    EdgeInferError,
    InvalidRequestError,
    NotAGenerativeModelError,
    NotAnEmbeddingModelError,
    short_repr,
)
from ..runtimes.base import cut_keeping_last

__all__ = [
    "MAX_BATCH_SIZE",
    "MAX_TEXT_CHARS",
    "EmbedResult",
    "GivenIds",
    "NotAGenerativeModelError",
    "NotAnEmbeddingModelError",
    "check_texts",
    "embed_texts",
    "is_embedding_backend",
    "pool",
]

logger = logging.getLogger(__name__)

MAX_TEXT_CHARS = 1 << 20  # characters of one text: far past any model's maximum length
MAX_BATCH_SIZE = 4096


@dataclass(frozen=True)
class EmbedResult:
    """Vectors float32 [n, dim] in input order, each text's token count (after truncation)
    and whether it was truncated."""

    vectors: np.ndarray
    tokens: list[int]
    truncated: list[bool]


def is_embedding_backend(backend: Any) -> bool:
    return getattr(backend, "kind", "generation") == "embedding"


def require_embedding(backend: Any, name: str) -> None:
    if not is_embedding_backend(backend):
        raise NotAnEmbeddingModelError(
            f"{name} generates text and cannot embed; load an embedding model, such as "
            "edgeinfer.load('all-minilm-l6-v2')"
        )


def require_generation(backend: Any, name: str) -> None:
    if is_embedding_backend(backend):
        raise NotAGenerativeModelError(
            f"{name} is an embedding model: it cannot generate or chat; use model.embed(texts)"
        )


def check_texts(texts: object, field: str = "texts") -> list[str]:
    """``texts`` (one string, or a non-empty list of strings) as a list; InvalidRequestError
    naming the field and the position otherwise."""
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(texts, (bytes, bytearray)) or not isinstance(texts, Sequence):
        raise InvalidRequestError(
            f"{field} must be a string or a list of strings, not {type(texts).__name__}"
        )
    if not texts:
        raise InvalidRequestError(f"{field} is empty: give at least one text")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"{field}[{i}]={short_repr(text, 40)} is not a string: every input is text"
            )
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidRequestError(
                f"{field}[{i}] has {len(text):,} characters, more than {MAX_TEXT_CHARS:,}; the "
                "model reads only its first tokens anyway: split long documents into passages"
            )
    return list(texts)


def check_batch_size(batch_size: object, most: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidRequestError(f"batch_size={short_repr(batch_size)} must be an integer >= 1")
    if batch_size > most:
        raise InvalidRequestError(
            f"batch_size={batch_size} is more than the memory plan holds ({most} texts of "
            "the maximum length); use a smaller batch_size or load with a larger memory_budget"
        )
    return batch_size


def pool(hidden: np.ndarray, mask: np.ndarray, mode: str) -> np.ndarray:
    """One vector per row of ``hidden`` [B, S, H] over the tokens ``mask`` [B, S] keeps."""
    keep = mask.astype(bool)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        last = keep.sum(1) - 1  # right padding: the last kept position
        return hidden[np.arange(hidden.shape[0]), last]
    if mode == "max":
        return np.where(keep[..., None], hidden, -np.inf).max(1)
    if mode == "mean":
        weights = keep[..., None].astype(np.float32)
        return (hidden * weights).sum(1) / np.maximum(weights.sum(1), 1e-9)
    raise EdgeInferError(f"unknown pooling {mode!r}")  # encoder_folder checked it


def normalized(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def embed_texts(
    backend: Any,
    texts: Sequence[str],
    *,
    normalize: bool,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
) -> EmbedResult:
    """The embeddings of checked ``texts``, in batches of ``batch_size`` texts of similar
    length (less padding); ``on_batch(n)`` after each batch of n texts (a progress bar)."""
    seqs, full = backend.tokenize(texts)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    dim = int(backend.info["embedding_dim"])
    out = np.empty((len(seqs), dim), np.float32)
    mode = backend.info["pooling"]
    pooled = getattr(backend, "pooled", None)  # a backend that pools itself (llama.cpp)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        if pooled is not None:
            vectors = pooled([seqs[i] for i in rows])
            out[rows] = normalized(vectors) if normalize else vectors
            if on_batch is not None:
                on_batch(len(rows))
            continue
        width = max(len(seqs[i]) for i in rows)
        ids = np.zeros((len(rows), width), np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for r, i in enumerate(rows):
            ids[r, : len(seqs[i])] = seqs[i]
            mask[r, : len(seqs[i])] = 1
        vectors = pool(backend.hidden_states(ids, mask), mask, mode)
        out[rows] = normalized(vectors) if normalize else vectors
        if on_batch is not None:
            on_batch(len(rows))
    tokens = [len(s) for s in seqs]
    return EmbedResult(out, tokens, [f > n for f, n in zip(full, tokens, strict=True)])


def log_truncation(result: EmbedResult, limit: int) -> None:
    cut = sum(result.truncated)
    if cut:
        logger.warning(
            "%d of %d texts were longer than the model's %d tokens and were truncated",
            cut,
            len(result.truncated),
            limit,
        )


def embed_for_model(
    backend: Any,
    name: str,
    plan: Any,
    texts: object,
    *,
    normalize: object = True,
    batch_size: object = None,
    on_batch: Callable[[int], None] | None = None,
) -> EmbedResult:
    """``Model.embed_detailed``: the request checked (model kind, texts, options), embedded
    in batches of ``batch_size`` (default: the memory plan's), L2-normalized if
    ``normalize``; ``on_batch(n)`` after each batch of n texts; truncation logged."""
    require_embedding(backend, name)
    checked = check_texts(texts)
    if not isinstance(normalize, bool):
        raise InvalidRequestError(f"normalize={short_repr(normalize)} must be True or False")
    most = int(getattr(plan, "batch_size", 0) or 32)
    size = most if batch_size is None else check_batch_size(batch_size, min(most, MAX_BATCH_SIZE))
    result = embed_texts(backend, checked, normalize=normalize, batch_size=size, on_batch=on_batch)
    log_truncation(result, backend.n_ctx)
    return result


class GivenIds:
    """``backend`` whose tokenizer answers with the given id lists (``Model.embed_ids``):
    every other attribute is the backend's own."""

    def __init__(self, backend: Any, seqs: list[list[int]]) -> None:
        self._backend, self._seqs = backend, seqs

    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        cut = cut_keeping_last(self._seqs, int(self._backend.n_ctx))
        return cut, [len(ids) for ids in self._seqs]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)
