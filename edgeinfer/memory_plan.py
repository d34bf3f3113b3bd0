"""``MemoryPlan``: the host memory one loaded model will take, part by part, as
``memory.plan_memory`` planned it (the terms and their measurements: ``memory.py``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MemoryPlan", "draft_text", "mb", "slots_text", "step_text"]


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
