"""``MemoryBudget``: the budget a plan must fit, made once from ``memory_budget``; and
``MemoryPlan``: the host memory one loaded model will take, part by part, as
``plan.plan_memory`` planned it (the terms and their measurements: ``plan.py``)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from ..errors import InvalidRequestError

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "MemoryBudget",
    "MemoryPlan",
    "draft_text",
    "mb",
    "parse_size",
    "slots_text",
    "step_text",
]

DEFAULT_BUDGET_FRACTION = 0.5  # of the RAM available now, when no budget is given


@dataclass(frozen=True)
class MemoryBudget:
    """``memory_budget`` made once where it comes in (``load()``): a limit in bytes, or None
    for the default rule, which ``resolve`` applies to the process being planned (what it
    holds plus half of the RAM available: the one default, for every kind of model)."""

    limit: int | None = None

    @classmethod
    def of(cls, value: MemoryBudget | int | str | None) -> MemoryBudget:
        """A budget from bytes, a size such as "512MB" or "1.5GiB", or None (the default);
        an invalid one raises InvalidRequestError."""
        if isinstance(value, MemoryBudget):
            return value
        return cls(None if value is None else parse_size(value))

    def resolve(self, process: int, available: int | None = None) -> tuple[int, str]:
        """The limit in bytes for a process holding ``process`` bytes, on a machine with
        ``available`` bytes of RAM available (default: this one's now), and its source."""
        if self.limit is not None:
            return self.limit, "memory_budget"
        free = psutil.virtual_memory().available if available is None else available
        limit = process + int(free * DEFAULT_BUDGET_FRACTION)
        return limit, f"{DEFAULT_BUDGET_FRACTION:.0%} of the {free / 1e6:.0f} MB available"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20, "mi": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40,
}  # fmt: skip


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "512MB", "1.5GiB", "800M" (M = 10^6, Mi = 2^20)."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"memory_budget={value!r} is invalid: expected bytes or a size")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidRequestError(f"memory_budget={value} is invalid: expected > 0 bytes")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            number = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if 0 < number < 2**62:
                return int(number)
    raise InvalidRequestError(
        f"memory_budget={value!r} is invalid: expected bytes or a size such as '512MB' or '1.5GiB'"
    )


@dataclass(frozen=True)
class MemoryPlan:
    """Host memory for one loaded model, planned before loading it. All figures in bytes."""

    budget: int
    budget_source: str
    process: int  # resident now, plus the engine's libraries if they are not loaded yet
    weights: int
    engine: int  # fixed structures: vocabulary, tokenizer, sessions
    kv_bytes_per_token: int
    kv_factor: float
    context_length: int
    trained_context: int
    batch_size: int
    compute: int  # compute buffers and the compute threads' own memory
    headroom: int
    threads: int = 1
    # The resident set measured once the engine held the weights (mapped model files counted
    # in full): replaces the estimated process + weights + engine in the total. None before.
    loaded: int | None = None
    # Sequence slots (load(..., parallel=N)): each holds a context_length-token KV cache.
    parallel: int = 1
    # A draft model for speculative decoding (load(..., speculative="draft:NAME")): its
    # weights, its KV cache of context_length tokens, and its engine structures and compute
    # buffers. 0 without one.
    draft_weights: int = 0
    draft_kv: int = 0
    draft_other: int = 0

    @property
    def draft(self) -> int:
        """Everything the draft model takes."""
        return self.draft_weights + self.draft_kv + self.draft_other

    @property
    def kv_per_slot(self) -> int:
        """One slot's KV cache: ``context_length`` tokens."""
        return int(self.kv_bytes_per_token * self.kv_factor * self.context_length)

    @property
    def kv_cache(self) -> int:
        """The KV cache of every slot."""
        return self.kv_per_slot * self.parallel

    @property
    def resident_before_kv(self) -> int:
        """What is resident before the KV cache: measured at load, else estimated."""
        if self.loaded is not None:
            return self.loaded
        return self.process + self.weights + self.engine

    @property
    def total(self) -> int:
        return self.resident_before_kv + self.kv_cache + self.compute + self.headroom + self.draft

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "kv_per_slot": self.kv_per_slot,
            "kv_cache": self.kv_cache,
            "draft": self.draft,
            "total": self.total,
        }

    def describe(self) -> str:
        before = (
            f"measured at load {mb(self.loaded)}"
            if self.loaded is not None
            else f"process {mb(self.process)}, weights {mb(self.weights)}, engine {mb(self.engine)}"
        )
        return (
            f"{mb(self.total)} of {mb(self.budget)} ({self.budget_source}): {before}, KV "
            f"cache {mb(self.kv_cache)} ({slots_text(self)}), compute {mb(self.compute)} "
            f"({step_text(self)}, {self.threads} threads), headroom {mb(self.headroom)}"
            f"{draft_text(self)}"
        )


def draft_text(plan: MemoryPlan) -> str:
    """The draft model's part of a plan, as text ("" without one)."""
    if not plan.draft:
        return ""
    return (
        f", draft model {mb(plan.draft)} (weights {mb(plan.draft_weights)}, KV cache "
        f"{mb(plan.draft_kv)}, engine and compute {mb(plan.draft_other)})"
    )


def slots_text(plan: MemoryPlan) -> str:
    if plan.parallel == 1:
        return f"{plan.context_length} tokens"
    return f"{plan.parallel} slots x {plan.context_length} tokens"


def step_text(plan: MemoryPlan) -> str:
    """The largest step the compute term is sized for."""
    if plan.parallel == 1:
        return f"batch {plan.batch_size}"
    return f"a {plan.batch_size}-token prefill chunk beside {plan.parallel - 1} decoding sequences"


def mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"
