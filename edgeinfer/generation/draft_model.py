"""A draft model for speculative decoding: a smaller model of the target's vocabulary whose
greedy tokens the target checks in one pass (``load(..., speculative="draft:NAME")``).

``DraftModel`` drives the draft's own backend (opened once by ``load()``: one sequence, the
target's context length, the same device and threads). Its KV cache follows the tokens the
target's cache holds: before each proposal it is rewound to the longest prefix it shares with
them (the drafts the target kept stay; the rejected ones go) and reads the rest, usually the
target's correction token alone; it then decodes k tokens greedily. Nothing it proposes
reaches the reply unless the target's sampler picks that token itself
(``edgeinfer.generation.speculative``), so the draft changes speed, never tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .speculative import DraftCosts

if TYPE_CHECKING:
    from ..runtimes.base import Backend

__all__ = ["DraftModel"]

logger = logging.getLogger(__name__)

_SYNC_TIMED = 2  # a proposal whose catch-up read more tokens than this is not timed whole
_READ_TIMED = 32  # catch-up reads this long or longer time a batched read per token
_CALIBRATION = 64  # tokens read (twice) at load to time a batched read


class DraftModel:
    """The draft model's backend, its cache's tokens and its measured step cost.

    ``name``: as ``speculative="draft:NAME"`` named it; ``names``: what else a request may
    call it (the resolved name, the path); ``memory``: the bytes the memory plan counted for
    it; ``prior_share``: a draft step in target steps before any is timed."""

    def __init__(
        self,
        backend: Backend,
        *,
        name: str,
        names: Iterable[str] = (),
        memory: int = 0,
        prior_share: float = 0.3,
    ) -> None:
        self.backend = backend
        self.name = name
        self.memory = memory
        self.costs = DraftCosts(prior_share=prior_share)
        self._names = frozenset([name, *names])
        self._tokens: list[int] = []  # the tokens in the draft's cache, in order
        self._trusted = 0  # leading tokens of _tokens last seen equal to the target's
        self._closed = False
        self._time_a_read()

    def _time_a_read(self) -> None:
        """Time a batched read at load (the second of two, the first having warmed the
        engine): whether reading a prompt pays back is weighed with it (``DraftBudget
        .pays_back``), and a draft that is never let read would never measure one."""
        n = min(_CALIBRATION, self.backend.n_ctx - 1, self.backend.tokenizer.n_vocab - 1)
        if n < _READ_TIMED:
            return
        ids = list(range(1, n + 1))
        try:
            for _ in range(2):
                self.backend.rewind(0)
                start = time.perf_counter()
                self.backend.prefill(ids)
            self.costs.record_read(n, time.perf_counter() - start)
        finally:
            self.backend.rewind(0)

    def matches(self, named: str) -> bool:
        """Whether a request's ``draft:NAME`` names this draft model."""
        return named in self._names

    @property
    def n_past(self) -> int:
        return len(self._tokens)

    def propose(self, cached: Sequence[int], pending: int, k: int) -> list[int]:
        """Up to ``k`` greedy tokens to follow ``cached`` (the target's cache) and ``pending``
        (the token the target reads next); fewer where the draft ends the reply or its cache
        is full."""
        k = min(k, self.backend.n_ctx - len(cached) - 1)
        if k <= 0 or self._closed:
            return []
        try:
            return self._propose(cached, pending, k)
        except BaseException:
            self._reset()  # a cache whose tokens are not known is read again next time
            raise

    def _propose(self, cached: Sequence[int], pending: int, k: int) -> list[int]:
        start = time.perf_counter()
        read, logits = self._sync(cached, pending)
        synced = time.perf_counter()
        tokenizer = self.backend.tokenizer
        drafts: list[int] = []
        while True:
            token = int(np.argmax(logits))
            drafts.append(token)
            if len(drafts) == k or tokenizer.is_end_of_generation(token):
                break
            logits = self.backend.decode(token)
            self._tokens.append(token)
        end = time.perf_counter()
        if read <= _SYNC_TIMED:
            self.costs.record(len(drafts), end - start)
        else:  # a long catch-up (the prompt) is not a draft step's cost: timed apart
            if read >= _READ_TIMED:  # a short one is mostly a step's fixed cost
                self.costs.record_read(read, synced - start)
            if len(drafts) > 1:
                self.costs.record(len(drafts) - 1, end - synced)
        return drafts

    def behind(self, cached: Sequence[int]) -> int:
        """Tokens a proposal after ``cached`` would read first: those the draft's cache
        lacks, and the pending one."""
        return len(cached) - self._shared(cached) + 1

    def _sync(self, cached: Sequence[int], pending: int) -> tuple[int, np.ndarray]:
        """Rewind the draft's cache to its longest prefix shared with ``cached`` and read
        the rest and ``pending``: how many tokens were read, and the logits after them."""
        n = self._shared(cached)  # the pending token is read again even when cached: its
        self.backend.rewind(n)  # logits were not kept
        del self._tokens[n:]
        rest = [*cached[n:], pending]
        logits = self.backend.prefill(rest)
        self._tokens.extend(rest)
        self._trusted = len(self._tokens)
        return len(rest), logits

    def _shared(self, cached: Sequence[int]) -> int:
        """How many leading tokens the draft's cache shares with ``cached``. The prefix seen
        equal at the last proposal is checked in one comparison (the target's cache grows
        between proposals; only a new prompt or a slide changes it), the rest one by one."""
        tokens = self._tokens
        n = min(self._trusted, len(cached), len(tokens))
        head = cached[:n]
        if tokens[:n] != (head if isinstance(head, list) else list(head)):
            n = 0
        limit = min(len(tokens), len(cached))
        while n < limit and tokens[n] == cached[n]:
            n += 1
        return n

    def _reset(self) -> None:
        self._tokens.clear()
        self._trusted = 0
        if not self._closed:
            try:
                self.backend.rewind(0)
            except Exception:  # the engine failed already: its cache is rewound on next use
                logger.debug("the draft model's cache could not be rewound", exc_info=True)

    def close(self) -> None:
        """Free the draft's engine and KV cache; calling it again does nothing."""
        if not self._closed:
            self._closed = True
            self._tokens.clear()
            self.backend.close()
