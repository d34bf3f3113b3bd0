"""Teacher-forced scoring: the log-probability the model gives each token of a given
continuation, and the likeliest alternatives at each place (``Model.score``).

The prompt is read as a generation request reads it (reusing the KV cache's common prefix);
the continuation goes through ``Backend.forward`` in passes of ``PASS`` tokens, which returns
every position's logits (or one-token steps on a backend that cannot). Log-probabilities are
of the model's own distribution (log-softmax of the raw logits, in float64): no temperature,
penalty or bias applies. Afterwards the cache holds the prompt, as after a request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidRequestError
from .sampling import is_int

if TYPE_CHECKING:
    from ..runtimes.base import Backend

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Scores",
    "TokenLogprob",
    "log_softmax",
    "score",
    "token_logprob",
    "top_alternatives",
]

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
PASS = 32  # continuation tokens per forward pass: within every backend's batch


@dataclass(frozen=True)
class Scores:
    """``logprobs[i]``: log P(token_ids[i] | prompt, token_ids[:i]); ``top[i]``: the
    ``top_logprobs`` likeliest (token id, log-probability) pairs at that place, likeliest
    first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]
    rows: np.ndarray | None = None  # with ``rows=True``: [len(token_ids), vocab] log-probs

    @property
    def total(self) -> float:
        """The continuation's log-probability: the sum over its tokens."""
        return float(sum(self.logprobs))


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (raw logits: before temperature,
    penalties, bias or a grammar's mask), and the ``top_logprobs`` likeliest at its place."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s TokenLogprob from one position's [vocab] logits."""
    lp = log_softmax(logits)
    return TokenLogprob(int(token), float(lp[token]), top_alternatives(lp, top))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., vocab] logits -> log-probabilities, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_alternatives(logprobs: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` likeliest (id, log-probability) of one position's [vocab] log-probabilities."""
    if n <= 0:
        return ()
    ids = np.argpartition(-logprobs, n - 1)[:n] if n < logprobs.size else np.arange(logprobs.size)
    ids = ids[np.argsort(-logprobs[ids], kind="stable")]
    return tuple((int(i), float(logprobs[i])) for i in ids)


def check_top(top_logprobs: object) -> int:
    if not is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:  # type: ignore[operator]
        raise InvalidRequestError(
            f"top_logprobs={top_logprobs!r} is invalid: expected an integer from 0 to "
            f"{MAX_TOP_LOGPROBS}"
        )
    return int(top_logprobs)  # type: ignore[call-overload]


def score(
    backend: Backend,
    history: Any,  # the model's generation.KVHistory
    prompt: Sequence[int],
    continuation: Sequence[int],
    top_logprobs: int = 0,
    rows: bool = False,
) -> Scores:
    """Scores of ``continuation`` after ``prompt``; the caller holds the model's turn.
    ``rows``: keep every place's whole distribution (``Scores.rows``)."""
    top = check_top(top_logprobs)
    if not isinstance(rows, bool):
        raise InvalidRequestError(f"rows={rows!r} is invalid: expected True or False")
    if not prompt or not continuation:
        raise InvalidRequestError("score needs a non-empty prompt and a non-empty continuation")
    if len(prompt) + len(continuation) > backend.n_ctx:
        raise InvalidRequestError(
            f"the prompt and continuation have {len(prompt) + len(continuation)} tokens but the "
            f"context holds {backend.n_ctx}; shorten them or load with a larger context_length"
        )
    reused = history.reuse(backend, prompt)
    logits = [np.array(backend.prefill(prompt[reused:]), dtype=np.float32)]
    history.tokens, history.batched = list(prompt), len(prompt)
    try:
        logits += _read(backend, list(continuation[:-1]))
    finally:
        backend.rewind(len(prompt))  # the cache holds the prompt, as after a request
    lp = log_softmax(np.stack(logits))  # [len(continuation), vocab]
    picked = tuple(float(lp[i, t]) for i, t in enumerate(continuation))
    tops = tuple(top_alternatives(row, top) for row in lp)
    return Scores(tuple(continuation), picked, tops, lp if rows else None)


def _read(backend: Any, ids: list[int]) -> list[np.ndarray]:
    """The logits after each of ``ids``, appended to the cache."""
    out: list[np.ndarray] = []
    if not getattr(backend, "multi_position_logits", False):
        return [np.array(backend.decode(t), dtype=np.float32) for t in ids]
    for start in range(0, len(ids), PASS):
        out += list(np.array(backend.forward(ids[start : start + PASS]), dtype=np.float32))
    return out
