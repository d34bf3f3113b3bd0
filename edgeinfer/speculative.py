"""Speculative decoding: draft a few tokens cheaply, check them all in one forward pass.

A drafter proposes the tokens it expects next; the target model reads the pending token and
the drafts in one pass (``Backend.forward``, the logits of every position); the generation
loop then steps its sampler over those rows in order and keeps each draft the sampler
picks itself, up to the first it does not, whose row already holds the target's own next
token. The rejected entries are rewound. Decode reads every weight once per pass, so each
kept draft is a token that cost no weight read of its own.

Exactness: every kept token is the token the sampler chose from the target's logits at its
position, with the same penalties, grammar and random draws as plain decoding. The drafts
are point masses, so this is Leviathan et al.'s rejection rule for a deterministic draft
(accept with the target's probability of the draft, else draw from the rest) realised by
coupling: the sampler draws as it would without speculation and the draft is kept when the
draw equals it. The output distribution is the target's, and under a seed the tokens are
the plain sampler's. What can differ is arithmetic: a pass over several positions may use
other kernels than a one-token step, so logits agree only to the engines' own noise.

Adaptive: drafting pays only when enough drafts are kept to cover the longer pass.
``PassCosts`` times the model's one-token steps and k-token passes as they run; per request
``DraftBudget`` tracks the share of drafts kept and drafts the k that maximises expected
tokens per second, or nothing when no k beats a plain step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .runtimes.base import Backend

__all__ = [
    "DraftBudget",
    "PassCosts",
    "PromptLookup",
    "Speculation",
    "SpeculativeConfig",
    "draft",
    "drop_unkept",
    "feed",
    "for_request",
    "parse_speculative",
]

MAX_DRAFT = 16  # tokens one pass checks beside the pending one: the most any setting takes
_DEFAULT_DRAFT = 8
_NGRAMS = (3, 2, 1)  # suffix lengths the prompt lookup tries, longest first


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: "off" or "lookup" (draft from the longest suffix match in the prompt and
    the reply so far); ``max_draft``: tokens drafted per pass at most; ``adaptive``: draft
    only while the measured gain is above 1 ("auto"), else draft whenever a match exists."""

    method: str = "off"
    max_draft: int = _DEFAULT_DRAFT
    adaptive: bool = True

    @property
    def on(self) -> bool:
        return self.method != "off"


OFF = SpeculativeConfig()
_HELP = (
    "expected 'off', 'auto' (prompt lookup, drafting only while it pays), 'lookup' or "
    f"'lookup:N' (prompt lookup, up to N drafted tokens per pass, 1 <= N <= {MAX_DRAFT})"
)


def parse_speculative(value: object) -> SpeculativeConfig:
    """The one reading of a ``speculative=`` setting (API, CLI and server alike)."""
    if isinstance(value, SpeculativeConfig):
        return value
    if value is None or value is False or value == "off":
        return OFF
    if not isinstance(value, str) or len(value) > 32:
        raise InvalidRequestError(f"speculative={value!r:.60} is invalid: {_HELP}")
    if value == "auto":
        return SpeculativeConfig("lookup", _DEFAULT_DRAFT, adaptive=True)
    name, _, count = value.partition(":")
    if name == "lookup":
        if not count:
            return SpeculativeConfig("lookup", _DEFAULT_DRAFT, adaptive=False)
        if count.isascii() and count.isdigit() and 1 <= int(count) <= MAX_DRAFT:
            return SpeculativeConfig("lookup", int(count), adaptive=False)
    raise InvalidRequestError(f"speculative={value!r} is invalid: {_HELP}")


class PromptLookup:
    """Drafts the tokens that followed the latest earlier occurrence of the sequence's
    suffix (3, 2 or 1 tokens long) in the prompt and the reply so far.

    Each n-gram maps to where its latest occurrence ended; the index grows by the tokens
    added since the last call, so a call costs O(new tokens), not O(context)."""

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # positions whose n-grams ending there are in the index

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``context`` (the whole sequence so far)."""
        n = len(context)
        # index the n-grams that end before the current end: the suffix itself must not
        # match its own position (it has no continuation yet)
        for end in range(max(self._indexed, 1), n):
            for size in _NGRAMS:
                if end >= size:
                    self._ends[tuple(context[end - size : end])] = end
        self._indexed = max(self._indexed, n)
        for size in _NGRAMS:
            if n < size:
                continue
            end = self._ends.get(tuple(context[n - size :]))
            if end is not None and end < n:
                return list(context[end : end + min(k, self.max_draft)])
        return []


def _prior(k: int) -> float:
    """Seconds of a pass over k + 1 tokens per one-token step, before any is measured: a
    guess between onnxruntime's (4 tokens ~1.3x a step) and llama.cpp's (~2.2x)."""
    return 1.0 + 0.25 * k


@dataclass
class PassCosts:
    """Measured seconds of the model's forward passes: one-token steps and passes over
    1 + k tokens (moving averages), shared by every request of one model."""

    step_s: float = 0.0
    pass_s: dict[int, float] = field(default_factory=dict)
    _weight: float = 0.2  # of each new measurement in the moving average

    def record_step(self, seconds: float) -> None:
        w = self._weight
        self.step_s = seconds if self.step_s == 0 else (1 - w) * self.step_s + w * seconds

    def record_pass(self, k: int, seconds: float) -> None:
        old = self.pass_s.get(k)
        w = self._weight
        self.pass_s[k] = seconds if old is None else (1 - w) * old + w * seconds

    def ratio(self, k: int) -> float:
        """A pass over 1 + k tokens in one-token steps."""
        measured = self.pass_s.get(k)
        if measured is None or self.step_s == 0:
            return _prior(k)
        return max(measured / self.step_s, 1.0)


class DraftBudget:
    """How many tokens to draft next, from the share of drafts kept so far (a moving
    average, optimistic at first) and the model's pass costs."""

    def __init__(self, config: SpeculativeConfig, costs: PassCosts) -> None:
        self.config = config
        self.costs = costs
        self.kept_share = 0.6
        self.drafted = 0
        self.accepted = 0
        self._idle = 0  # steps since drafting last looked worth it

    def k(self) -> int:
        """Tokens to draft before the next pass; 0 for a plain step."""
        top = self.config.max_draft
        if not self.config.adaptive:
            return top
        best, best_gain = 0, 1.0
        a = self.kept_share
        for k in range(1, top + 1):
            # tokens a pass yields: the pending token's row, then each kept draft's
            expected = sum(a**i for i in range(k + 1))
            gain = expected / self.costs.ratio(k)
            if gain > best_gain:
                best, best_gain = k, gain
        if best == 0:
            self._idle += 1
            if self._idle >= 32:  # look again now and then: the text may have turned to copying
                self._idle = 0
                return 1
        return best

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.kept_share = 0.7 * self.kept_share + 0.3 * (accepted / drafted)


class Speculation:
    """One request's drafter and draft budget, over its model's pass costs."""

    def __init__(self, config: SpeculativeConfig, costs: PassCosts) -> None:
        self.costs = costs
        self.budget = DraftBudget(config, costs)
        self._lookup = PromptLookup(config.max_draft)

    def propose(self, context: Sequence[int], room: int, constraint: Any = None) -> list[int]:
        """Tokens to check after ``context``'s last one, at most ``room``; [] for a plain step.
        Under a grammar (``constraint``) the tokens it forces come first: the sampler picks
        them unless the model prefers another spelling of the same bytes, so they are drafted
        whatever the budget says (grammar fast-forward)."""
        if constraint is not None:
            forced = constraint.forced(min(room, MAX_DRAFT))
            if forced:
                return forced
        k = min(self.budget.k(), room)
        return self._lookup.propose(context, k) if k > 0 else []


def for_request(
    asked: SpeculativeConfig | None, default: SpeculativeConfig, backend: Any, costs: PassCosts
) -> Speculation | None:
    """A request's speculative decoding: its own setting, else its model's; None when off or
    when the backend cannot return the logits of several positions in one pass."""
    setting = default if asked is None else asked
    if not setting.on or not getattr(backend, "multi_position_logits", False):
        return None
    return Speculation(setting, costs)


def draft(
    speculation: Speculation | None, context: Sequence[int], room: int, constraint: Any
) -> list[int]:
    """The tokens to check after ``context`` (see ``Speculation.propose``); [] without one."""
    return [] if speculation is None else speculation.propose(context, room, constraint)


def feed(
    backend: Backend, token: int, drafts: list[int], speculation: Speculation | None
) -> Sequence[np.ndarray]:
    """Read ``token`` (and the drafts after it, in the same pass); the logits of each."""
    if speculation is None:
        return [backend.decode(token)]
    start = time.perf_counter()
    if not drafts:
        rows: Sequence[np.ndarray] = [backend.decode(token)]
        speculation.costs.record_step(time.perf_counter() - start)
        return rows
    rows = backend.forward([token, *drafts])  # type: ignore[attr-defined]
    speculation.costs.record_pass(len(drafts), time.perf_counter() - start)
    return rows


def drop_unkept(backend: Backend, history: Any) -> None:
    """Rewind the cache entries after ``history``'s tokens (a generation.KVHistory): the
    drafts the sampler did not pick."""
    if backend.n_past > len(history.tokens):
        backend.rewind(len(history.tokens))
