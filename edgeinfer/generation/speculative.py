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

Drafters: prompt lookup (``PromptLookup``: the tokens that followed an earlier occurrence
of the text's suffix) or a draft model (``draft_model.DraftModel``: a smaller model
of the same vocabulary, opened by ``load(speculative="draft:NAME")``, decoding greedily).

Adaptive: drafting pays only when enough drafts are kept to cover the longer pass (and, with
a draft model, the draft's own steps). ``pass_costs.PassCosts`` times the model's one-token
steps and k-token passes at load and as they run, ``DraftCosts`` a draft model's steps; per request
``DraftBudget`` tracks the share of drafts kept and drafts the k that maximises expected
tokens per second, or nothing when no k beats a plain step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import InvalidRequestError
from .pass_costs import PassCosts

if TYPE_CHECKING:
    from ..runtimes.base import Backend

__all__ = [
    "DraftBudget",
    "DraftCosts",
    "Drafter",
    "PassCosts",
    "PromptLookup",
    "Speculation",
    "SpeculativeConfig",
    "check_setting",
    "draft",
    "drop_unkept",
    "feed",
    "for_request",
    "parse_speculative",
]

MAX_DRAFT = 16  # tokens one pass checks beside the pending one: the most any setting takes
_DEFAULT_DRAFT = 8
_NGRAMS = (3, 2, 1)  # suffix lengths the prompt lookup tries, longest first


class Drafter(Protocol):
    """A draft model as speculative decoding uses it (``draft_model.DraftModel``)."""

    costs: DraftCosts  # its measured steps
    memory: int  # the bytes the memory plan counted for it

    def propose(self, cached: Sequence[int], pending: int, k: int) -> list[int]: ...

    def behind(self, cached: Sequence[int]) -> int: ...

    def matches(self, named: str) -> bool: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: "off", "lookup" (draft from the longest suffix match in the prompt and the
    reply so far) or "draft" (a draft model's greedy tokens); ``max_draft``: tokens drafted
    per pass at most; ``adaptive``: draft only while the measured gain is above 1 ("auto",
    "draft:NAME"), else draft whenever there is something to draft; ``draft``: the draft
    model as named (a catalog name or a path); ``drafter``: the ``DraftModel`` load() opened
    for it (a request's own setting has none: it uses its model's)."""

    method: str = "off"
    max_draft: int = _DEFAULT_DRAFT
    adaptive: bool = True
    draft: str | None = None
    drafter: Drafter | None = field(default=None, compare=False, repr=False)

    @property
    def on(self) -> bool:
        return self.method != "off"

    @property
    def info(self) -> dict[str, Any]:
        """For ``Model.info["speculative"]``: the method, the draft model and its planned
        memory in bytes (weights, engine, KV cache, compute; 0 without one)."""
        drafter = self.drafter
        return {
            "method": self.method,
            "max_draft": self.max_draft,
            "adaptive": self.adaptive,
            "draft": self.draft,
            "draft_memory": drafter.memory if drafter is not None else 0,
        }

    def close(self) -> None:
        """Free the draft model, if load() opened one; calling it again does nothing."""
        if self.drafter is not None:
            self.drafter.close()


OFF = SpeculativeConfig()
_HELP = (
    "expected 'off', 'auto' (prompt lookup, drafting only while it pays), 'lookup' or "
    f"'lookup:N' (prompt lookup, up to N drafted tokens per pass, 1 <= N <= {MAX_DRAFT}), "
    "'draft:NAME' (a draft model: a catalog name or a path, drafting while it pays) or "
    "'draft:NAME:N' (N tokens of the draft model per pass)"
)
_MAX_NAME = 4096  # characters of a draft model's name or path


def parse_speculative(value: object) -> SpeculativeConfig:
    """The one reading of a ``speculative=`` setting (API, CLI and server alike)."""
    if isinstance(value, SpeculativeConfig):
        return value
    if value is None or value is False or value == "off":
        return OFF
    if isinstance(value, str) and value.startswith("draft:"):
        return _parse_draft(value)
    if not isinstance(value, str) or len(value) > 32:
        raise InvalidRequestError(f"speculative={value!r:.60} is invalid: {_HELP}")
    if value == "auto":
        return SpeculativeConfig("lookup", _DEFAULT_DRAFT, adaptive=True)
    name, _, count = value.partition(":")
    if name == "lookup":
        if not count:
            return SpeculativeConfig("lookup", _DEFAULT_DRAFT, adaptive=False)
        if _count(count) is not None:
            return SpeculativeConfig("lookup", int(count), adaptive=False)
    raise InvalidRequestError(f"speculative={value!r} is invalid: {_HELP}")


def _count(text: str) -> int | None:
    """``text`` as a draft length (ASCII digits, 1 to MAX_DRAFT); None otherwise."""
    if text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_DRAFT:
        return int(text)
    return None


def _parse_draft(value: str) -> SpeculativeConfig:
    """``draft:NAME`` (adaptive, up to 8 tokens a pass) or ``draft:NAME:N`` (N a pass)."""
    rest = value[len("draft:") :]
    name, colon, tail = rest.rpartition(":")
    count = None
    if colon and tail.isascii() and tail.isdigit():  # a trailing ":N" is a count, never a name
        count = _count(tail)
        if count is None:
            raise InvalidRequestError(f"speculative={value!r:.80} is invalid: {_HELP}")
    else:
        name = rest
    if not name or len(name) > _MAX_NAME or not _nameable(name):
        raise InvalidRequestError(
            f"speculative={value!r:.80} names no draft model: expected 'draft:' and a catalog "
            "name or a path (printable text), optionally ':N' (tokens a pass)"
        )
    if count is None:
        return SpeculativeConfig("draft", _DEFAULT_DRAFT, adaptive=True, draft=name)
    return SpeculativeConfig("draft", count, adaptive=False, draft=name)


def _nameable(name: str) -> bool:
    """A name a path can be made of: no control characters, encodable for the file system."""
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return False
    try:
        os.fsencode(name)
    except (UnicodeError, ValueError):
        return False
    return True


def check_setting(asked: SpeculativeConfig | None, default: SpeculativeConfig) -> None:
    """Refuse a request's ``speculative="draft:..."`` its model cannot run: a draft model is
    opened at load, so a request may name only the one its model was loaded with."""
    if asked is None or asked.method != "draft":
        return
    drafter = default.drafter
    if drafter is None:
        raise InvalidRequestError(
            f"speculative={'draft:' + str(asked.draft)!r:.80}: this model was loaded without "
            "a draft model, and a draft model is opened at load: load the model with "
            "speculative='draft:NAME', or ask for 'off', 'auto' or 'lookup'"
        )
    if asked.draft != default.draft and not drafter.matches(str(asked.draft)):
        raise InvalidRequestError(
            f"speculative={'draft:' + str(asked.draft)!r:.80}: this model was loaded with the "
            f"draft model {default.draft!r}, and a draft model is opened at load: name that "
            "one (or leave the field out), or ask for 'off', 'auto' or 'lookup'"
        )


class PromptLookup:
    """Drafts the tokens that followed the latest earlier occurrence of the sequence's
    suffix (3, 2 or 1 tokens long) in the prompt and the reply so far.

    Each n-gram maps to where its latest occurrence ended; the index grows by the tokens
    added since the last call, so a call costs O(new tokens), not O(context)."""

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # positions whose n-grams ending there are in the index
        self.matched = 0  # the length of the suffix the last proposal matched (0: none)

    def propose(self, context: Sequence[int], k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` tokens to follow ``context`` (the whole sequence so far) and then
        ``after`` (tokens about to be read with the draft, not yet part of the sequence:
        they join the suffix matched, not the index)."""
        n = len(context)
        # index the n-grams that end before the current end: the suffix itself must not
        # match its own position (it has no continuation yet)
        for end in range(max(self._indexed, 1), n):
            for size in _NGRAMS:
                if end >= size:
                    self._ends[tuple(context[end - size : end])] = end
        self._indexed = max(self._indexed, n)
        text = [*context, *after] if after else context
        for size in _NGRAMS:
            if len(text) < size:
                continue
            end = self._ends.get(tuple(text[len(text) - size :]))
            if end is not None and end < n:
                self.matched = size
                return list(text[end : end + min(k, self.max_draft)])
        self.matched = 0
        return []


@dataclass
class DraftCosts:
    """Measured seconds of a draft model's steps (one drafted token each, a moving average),
    shared by every request of its target. ``prior_share``: a draft step in target steps
    before any is measured (the draft's weights over the target's: decode reads each once)."""

    prior_share: float = 0.3
    step_s: float = 0.0
    read_s: float = 0.0  # per token of a catch-up read (a batch), once one is measured
    _weight: float = 0.2

    def record_read(self, tokens: int, seconds: float) -> None:
        per_token, w = seconds / tokens, self._weight
        self.read_s = per_token if self.read_s == 0 else (1 - w) * self.read_s + w * per_token

    def read_ratio(self, tokens: int, target_step_s: float) -> float:
        """Reading ``tokens`` in one batch, in the target's one-token steps (before one is
        measured: half a draft step each, a batched read being cheaper than steps)."""
        if self.read_s == 0 or target_step_s == 0:
            return tokens * 0.5 * self.ratio(1, target_step_s)
        return tokens * self.read_s / target_step_s

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        per_token, w = seconds / tokens, self._weight
        self.step_s = per_token if self.step_s == 0 else (1 - w) * self.step_s + w * per_token

    def ratio(self, k: int, target_step_s: float) -> float:
        """Drafting k tokens, in the target's one-token steps."""
        if self.step_s == 0 or target_step_s == 0:
            return k * self.prior_share
        return k * self.step_s / target_step_s


class DraftBudget:
    """How many tokens to draft next, from the share of drafts kept so far (a moving
    average, optimistic at first), the model's pass costs and, with a draft model, the
    draft's own steps (``drafting``)."""

    def __init__(
        self, config: SpeculativeConfig, costs: PassCosts, drafting: DraftCosts | None = None
    ) -> None:
        self.config = config
        self.costs = costs
        self.drafting = drafting
        self.kept_share = 0.6  # of a draft model's drafts, or of drafts of no kind
        self._shares: dict[int, float] = {}  # per kind: the suffix length a lookup matched
        self.drafted = 0
        self.accepted = 0
        self._idle = 0  # steps since drafting last looked worth it

    def share(self, kind: int | None = None) -> float:
        """The share of drafts kept so far, of drafts of ``kind`` (a lookup's matched suffix
        length: a 3-token match is kept far more often than a 1-token one)."""
        return self.kept_share if kind is None else self._shares.get(kind, 0.6)

    def k(self, kind: int | None = None) -> int:
        """Tokens to draft before the next pass (drafts of ``kind``); 0 for a plain step."""
        top = self.config.max_draft
        if not self.config.adaptive:
            return top
        if self.drafting is not None and self.costs.step_s == 0:
            return 0  # a plain step first: the draft's cost is weighed against a measured one
        best, best_gain = 0, 1.0
        a = self.share(kind)
        for k in range(1, top + 1):
            # tokens a pass yields: the pending token's row, then each kept draft's
            expected = sum(a**i for i in range(k + 1))
            gain = expected / (self.costs.ratio(k) + self._drafting_cost(k))
            if gain > best_gain:
                best, best_gain = k, gain
        if best == 0:
            self._idle += 1
            if self._idle >= 32:  # look again now and then: the text may have turned to copying
                self._idle = 0
                return 1
        return best

    def pays_back(self, behind: int, k: int, left: int | None) -> bool:
        """Whether a draft model that must first read ``behind`` tokens (a new prompt)
        saves more over the ``left`` tokens still to come, at the gain drafting ``k``
        promises, than that read costs. ``left`` None: no limit known."""
        if self.drafting is None or not self.config.adaptive or behind <= 2 or left is None:
            return True
        a = self.kept_share
        expected = sum(a**i for i in range(k + 1))
        saved = max(0.0, 1.0 - (self.costs.ratio(k) + self._drafting_cost(k)) / expected)
        return left * saved > self.drafting.read_ratio(behind, self.costs.step_s)

    def _drafting_cost(self, k: int) -> float:
        """Drafting k tokens, in one-token steps of the model (0 for prompt lookup)."""
        return 0.0 if self.drafting is None else self.drafting.ratio(k, self.costs.step_s)

    def record(self, drafted: int, accepted: int, kind: int | None = None) -> None:
        """A pass kept the first ``accepted`` of its ``drafted`` tokens. The drafts after the
        first one refused were never put to the test (the pass stops there), so the share
        kept is learned from the tested ones: the kept, and the refused one if any."""
        self.drafted += drafted
        self.accepted += accepted
        if not drafted:
            return
        tested = accepted + (1 if accepted < drafted else 0)
        share = 0.7 * self.share(kind) + 0.3 * (accepted / tested)
        if kind is None:
            self.kept_share = share
        else:
            self._shares[kind] = share


class Speculation:
    """One request's drafter (prompt lookup, or its model's draft model) and draft budget,
    over its model's pass costs."""

    def __init__(
        self, config: SpeculativeConfig, costs: PassCosts, drafter: Drafter | None = None
    ) -> None:
        self.costs = costs
        self.drafter = drafter
        self.budget = DraftBudget(config, costs, drafter.costs if drafter is not None else None)
        self._lookup = PromptLookup(config.max_draft)
        self._forced = 0  # of the last proposal's drafts, the grammar's forced ones
        self._kind: int | None = None  # the last lookup's matched suffix length

    def propose(
        self,
        context: Sequence[int],
        room: int,
        constraint: Any = None,
        cached: Sequence[int] | None = None,
        left: int | None = None,
    ) -> list[int]:
        """Tokens to check after ``context``'s last one, at most ``room``; [] for a plain step.
        Under a grammar (``constraint``) the tokens it forces come first: the sampler picks
        them unless the model prefers another spelling of the same bytes, so they are drafted
        whatever the budget says (grammar fast-forward), and prompt lookup goes on after them
        in the same pass (a key the schema spells, then the value copied from the prompt).
        A draft is cut at the first token the grammar refuses: the sampler could not pick it.
        ``cached``: the tokens in the model's cache before that last one (``context`` less
        it, unless the context slid): what a draft model keeps its own cache in step with.
        ``left``: tokens the reply may still take (a draft model that must first read the
        prompt drafts only where that read pays back over them)."""
        forced = constraint.forced(min(room, MAX_DRAFT)) if constraint is not None else []
        self._forced, self._kind = len(forced), None
        space = min(room, MAX_DRAFT) - len(forced)
        if space <= 0:
            return forced
        if self.drafter is None:
            guessed = self._lookup.propose(context, space, after=forced)
            self._kind = self._lookup.matched
            guessed = guessed[: self.budget.k(self._kind)] if guessed else []
        else:
            if forced:
                return forced  # a draft model has not read the forced tokens: they go alone
            k = min(self.budget.k(), space)
            if k <= 0:
                return []
            window = context[:-1] if cached is None else cached
            if not self.budget.pays_back(self.drafter.behind(window), k, left):
                return []
            guessed = self.drafter.propose(window, context[-1], k)
        drafts = forced + guessed
        if constraint is not None and guessed:
            drafts = drafts[: max(len(forced), constraint.valid_prefix(drafts))]
        return drafts

    def record(self, checked: int, kept: int) -> None:
        """What the last pass did with its drafts: ``checked`` of them read, ``kept`` picked.
        The budget learns from the guessed ones only: forced tokens are kept by the grammar,
        not by the drafter's skill."""
        forced = min(self._forced, checked)
        self.budget.record(checked - forced, max(0, kept - forced), self._kind)


def for_request(
    asked: SpeculativeConfig | None, default: SpeculativeConfig, backend: Any, costs: PassCosts
) -> Speculation | None:
    """A request's speculative decoding: its own setting, else its model's; None when off or
    when the backend cannot return the logits of several positions in one pass. A request's
    "draft:NAME" runs its model's draft model (``check_setting`` refuses another)."""
    check_setting(asked, default)
    setting = default if asked is None else asked
    if not setting.on or not getattr(backend, "multi_position_logits", False):
        return None
    return Speculation(setting, costs, default.drafter if setting.method == "draft" else None)


def draft(
    speculation: Speculation | None,
    context: Sequence[int],
    room: int,
    constraint: Any,
    cached: Sequence[int] | None = None,
    left: int | None = None,
) -> list[int]:
    """The tokens to check after ``context`` (see ``Speculation.propose``); [] without one."""
    if speculation is None:
        return []
    return speculation.propose(context, room, constraint, cached, left)


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
