"""The memory plan: how much host memory a model will take, computed before loading it.

A ``MemoryPlan`` adds up, from the model's own metadata (GGUF header or ONNX manifest):

- the process as it is now (its resident set) plus the engine's libraries if not yet loaded;
- the weights as they will be resident (llama.cpp maps the GGUF file; onnxruntime maps the
  ONNX external-data file and pre-packs some weights, hence a per-quantization factor);
- the engine's fixed structures (vocabulary, tokenizer);
- the KV cache: 2 (K and V) x layers x KV heads x head size x element size, per token of
  context — times 2 for ONNX graphs, whose step writes the grown cache beside the old one;
- the compute buffers, which grow with the batch (prefill chunk) and the context: attention
  scores are batch x context x heads floats per layer;
- a small headroom.

The budget is ``memory_budget`` (bytes or "512MB", "1.5GiB"), else the process's resident set
now plus half of the RAM available now. The plan bounds the process's peak resident set
(``VmHWM``, what the kernel's OOM killer weighs), so everything in the process counts.

``context_length=None`` takes the largest context that fits (a multiple of 256, capped by the
trained context), trading prefill batch size for context when memory is short; an explicit
context that does not fit, or a budget below the weights and overheads, raises
``MemoryBudgetError`` before anything is allocated.

Many sequences (``load(..., parallel=N)``). N slots share the weights and hold N KV caches of
``context_length`` tokens each: the KV term is N x one slot's. The compute term is sized for
the largest step the engine runs: one prefill chunk of ``batch_size`` tokens beside N - 1
sequences decoding one token each (the slot being prefilled does not decode), every row's
attention scores spanning its own slot's context, plus each decoding row's logits (twice: the
engine's output and the array a batched step returns). N and the context are fitted
together: an explicit N is kept and the context shrinks to what fits; when even
``MIN_CONTEXT`` tokens per slot (or the explicit context) do not fit, ``MemoryBudgetError``
names the weights, the KV cache (N slots), the activations and the runtime overhead
(process, engine, headroom), each slot's KV, and the most slots that would fit.
``parallel="auto"`` takes the most slots, up to ``AUTO_MAX_PARALLEL`` (8), whose plan keeps
a useful context in each: the explicit ``context_length`` if given, else ``AUTO_MIN_CONTEXT``
(2048 tokens: a system prompt, a few turns and a reply; a batch job's rows are shorter), or
the trained context if that is shorter; else one slot, planned as usual. Why 8: on this class
of CPU one forward pass over 8 tokens costs about what it costs over 1 to 2 (ONNX 4.2-5.2x
throughput at 8, llama.cpp 2.3x), while 16 adds little (ONNX 5.2-6.0x, llama.cpp 2.3-2.6x:
``shared/notes/batching.md``) and each stream would slow to a third of its speed alone.

A draft model (``load(..., speculative="draft:NAME")``) is planned beside its target: its
weights, its engine structures, its KV cache of the target's context (one sequence) and its
compute buffers for the target's prefill batch, by its own engine's costs. Those terms grow
with the context, so the context fitted to the budget is the one both caches hold.

Measured at load (``FitAtLoad``). What an engine makes of the weights depends on the machine:
llama.cpp repacks some quantizations for the CPU's kernels (AVX2, AVX-512, AMX, NEON),
onnxruntime's MLAS pre-packs int8 weights per instruction set, and the libraries themselves
differ. So once the engine holds the weights, and before the KV cache is sized, the backend
measures the process's resident set — counting the files the engine maps (the weights) at
their full size, since their pages become resident only as kernels read them (an embedding
row when its token first appears) — and the context is fitted again to what is left. What
still grows after that point is the KV cache, the compute buffers and the compute threads.

Margin (headroom), on top of every plan: 4 MiB + 2% of the planned total + 5% of what grows
after the load (KV cache and compute), plus 2 MiB per compute thread in the compute term.
Why: the per-thread term covers each thread's stack pages, its glibc malloc arena and its
kernels' scratch (llama.cpp's work buffer share, MLAS's thread-local packing buffers); the
peak moved by < 0.2 MiB per added thread here (GGUF and ONNX int8, 1 to 4 threads), so 2 MiB
is 10x that. The fractions cover allocator slack that depends on the sequence of sizes
(onnxruntime's arena, glibc's heap trimming) and kernels that pick other block sizes on
other CPUs; the growth terms themselves were measured to over-estimate the growth here (see
the README's memory table: peak - plan over every run). Before the load the weights are an
estimate per quantization; after it, a machine whose engine keeps more resident gets a
shorter context, not a broken promise.

The constants below were measured on the development machine (x86-64, Linux, Python 3.11,
llama-cpp-python 0.3.36, onnxruntime 1.32) with the default model (SmolLM2-135M: GGUF Q4_1
and its ONNX conversions): the per-context and per-batch terms from
``python benchmarks/bench_memory.py --grid`` (contexts 512..8192 x batches 64/512, no budget;
add ``--model DIR`` for an ONNX folder), the fixed terms from the resident set after each
import and load step (``python benchmarks/bench_memory.py --parts [--model DIR]``).
``python benchmarks/bench_memory.py`` checks the plan against the measured peak under
budgets and thread counts. Other architectures, vocabularies and platforms were not
measured: the weights, KV and score terms scale with the model's own metadata, the fixed
terms do not (and the weights are measured at load).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from dataclasses import dataclass

import psutil

from ..config import check_parallel  # where load() checks it; the plan takes it checked
from ..errors import InvalidRequestError, MemoryBudgetError
from .budget import (
    DEFAULT_BUDGET_FRACTION,
    MemoryBudget,
    MemoryPlan,
    draft_text,
    mb,
    parse_size,
    slots_text,
    step_text,
)
from .costs import SLOT_LOGITS_BYTES, THREAD_BYTES, EngineCosts, costs_for
from .rss import peak_rss, resident_with_mapped_files
from .shape import ModelShape

logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_MAX_PARALLEL",
    "AUTO_MIN_CONTEXT",
    "DEFAULT_BUDGET_FRACTION",
    "FRESH_PROCESS_BYTES",
    "MIN_CONTEXT",
    "THREAD_BYTES",
    "FitAtLoad",
    "MemoryBudget",
    "MemoryPlan",
    "parse_size",
    "plan_memory",
]

MiB = 2**20
MIN_CONTEXT = 256  # tokens: a smaller plan is refused rather than offered
_CONTEXT_STEP = 256
_BATCHES = (512, 256, 128, 64, 32)  # prefill batch sizes tried, largest first
# The margin (headroom) kept on top of every plan; why these figures: see "Margin" above.
_HEADROOM = 4 * MiB
_HEADROOM_FRACTION = 0.02  # of the planned total
_GROWTH_MARGIN_FRACTION = 0.05  # of what grows after the load (KV cache, compute, threads)
# parallel="auto": the most slots tried, and the per-slot context each must keep (see
# "Many sequences" above for why these figures).
AUTO_MAX_PARALLEL = 8
AUTO_MIN_CONTEXT = 2048

# A fresh `python -c "import edgeinfer"` (Python, numpy, psutil, edgeinfer): used when
# planning for another machine's inventory, where this process's own size means nothing.
FRESH_PROCESS_BYTES = 36 * MiB


def plan_memory(
    shape: ModelShape,
    *,
    budget: MemoryBudget | int | str | None = None,
    context_length: int | None = None,
    available: int | None = None,
    process: int | None = None,
    engine_loaded: bool | None = None,
    threads: int = 1,
    loaded: int | None = None,
    batches: tuple[int, ...] = _BATCHES,
    parallel: int | str = 1,
    draft: ModelShape | None = None,
) -> MemoryPlan:
    """Plan ``shape``'s memory within ``budget``; raise ``MemoryBudgetError`` if it cannot fit.

    ``available`` (RAM available now) and ``process`` (this process's resident set) default
    to this machine's; pass a recorded machine's to plan for it. ``threads`` is the number of
    compute threads. ``loaded`` is the resident set measured once the engine holds the
    weights (see ``FitAtLoad``): it then replaces the estimated process, weights and engine.
    ``parallel`` is the number of sequence slots (each with a ``context_length`` cache), or
    "auto": the most slots, up to ``AUTO_MAX_PARALLEL``, that keep a useful context (see
    "Many sequences" above). ``draft``: a draft model's shape, planned beside this one (its
    own slot of the same context).
    """
    costs = costs_for(shape)
    if process is None:
        process = psutil.Process().memory_info().rss
    if engine_loaded is None:
        engine_loaded = _engine_module(shape) in sys.modules
    if not engine_loaded:
        process += costs.import_bytes
    if draft is not None and _engine_module(draft) != _engine_module(shape):
        if _engine_module(draft) not in sys.modules:
            process += costs_for(draft).import_bytes
    limit, source = MemoryBudget.of(budget).resolve(process, available)
    fixed = _fixed_terms(shape, costs, limit, source, process, threads, loaded)
    sizing = _Sizing(costs, shape, fixed, _draft_sizing(draft, limit, source, threads))
    if parallel == "auto":
        return _auto(sizing, context_length, limit, batches)
    return _fit(sizing.with_slots(check_parallel(parallel)), context_length, limit, batches)


def _engine_module(shape: ModelShape) -> str:
    return "llama_cpp" if shape.format == "gguf" else "onnxruntime"


def _draft_sizing(
    draft: ModelShape | None, limit: int, source: str, threads: int
) -> _Sizing | None:
    """A draft model's terms: its own weights, engine, one slot of KV and compute (the
    process it runs in is the target's, counted once)."""
    if draft is None:
        return None
    costs = costs_for(draft)
    return _Sizing(costs, draft, _fixed_terms(draft, costs, limit, source, 0, threads, None))


def _fixed_terms(
    shape: ModelShape, costs: EngineCosts, limit: int, source: str, process: int,
    threads: int, loaded: int | None,
) -> MemoryPlan:  # fmt: skip
    """The terms that do not depend on the context or the batch: a plan with no context, no
    compute and no headroom yet."""
    factor = costs.weight_factor.get(shape.quantization, costs.weight_factor["default"])
    return MemoryPlan(
        budget=limit,
        budget_source=source,
        process=process,
        weights=int(shape.weight_bytes * factor),
        engine=int(
            costs.fixed_bytes
            + costs.vocab_bytes * shape.n_vocab
            + costs.tokenizer_file_factor * shape.tokenizer_bytes
        ),
        kv_bytes_per_token=shape.kv_bytes_per_token,
        kv_factor=costs.kv_factor,
        context_length=0,
        trained_context=shape.trained_context,
        batch_size=0,
        compute=0,
        headroom=0,
        threads=threads,
        loaded=loaded,
    )


@dataclass(frozen=True)
class _Sizing:
    """What every candidate plan for one model shares: the engine's costs, the model's
    shape, and the terms that do not depend on the context or the batch (``fixed``: a plan
    with no context, no compute and no headroom)."""

    costs: EngineCosts
    shape: ModelShape
    fixed: MemoryPlan
    drafter: _Sizing | None = None  # a draft model's, planned beside this model

    def with_slots(self, parallel: int) -> _Sizing:
        return dataclasses.replace(self, fixed=dataclasses.replace(self.fixed, parallel=parallel))

    def plan(self, ctx: int, batch: int) -> MemoryPlan:
        """The plan for ``parallel`` slots of a ``ctx``-token context, read in prefill
        chunks of ``batch`` tokens while the other slots decode (see "Many sequences")."""
        batch = min(batch, ctx)
        costs, shape = self.costs, self.shape
        decoding = self.fixed.parallel - 1  # the slot being prefilled does not decode
        compute = int(
            costs.score_bytes * (batch + decoding) * ctx * shape.n_heads
            + costs.logits_per_batch_token * batch * shape.n_vocab
            + costs.batch_token_bytes * batch
            + SLOT_LOGITS_BYTES * decoding * shape.n_vocab
            + costs.compute_fixed_bytes
            + costs.thread_bytes * self.fixed.threads
        )
        draft = dataclasses.replace(
            self.fixed, context_length=ctx, batch_size=batch, compute=compute
        )
        if self.drafter is not None:  # the draft model: one slot of the same context
            second = self.drafter.plan(ctx, batch)
            draft = dataclasses.replace(
                draft,
                draft_weights=second.weights,
                draft_kv=second.kv_cache,
                draft_other=second.engine + second.compute,
            )
        return dataclasses.replace(draft, headroom=_headroom(draft))


def _headroom(draft: MemoryPlan) -> int:
    """The margin on top of ``draft`` (whose headroom is 0): see "Margin" above."""
    growth = draft.kv_cache + draft.compute + draft.draft_kv + draft.draft_other
    return int(_HEADROOM + _HEADROOM_FRACTION * draft.total + _GROWTH_MARGIN_FRACTION * growth)


def _fit(
    sizing: _Sizing, context_length: int | None, limit: int, batches: tuple[int, ...]
) -> MemoryPlan:
    """The plan for ``context_length``, else the largest context that fits ``limit``."""
    plan_for = sizing.plan
    trained_context = sizing.shape.trained_context
    trained = trained_context if trained_context > 0 else 2**31
    if context_length is not None:
        if context_length > trained:
            raise InvalidRequestError(
                f"context_length={context_length} exceeds the model's trained context "
                f"({trained} tokens); use at most {trained}"
            )
        fits = [p for p in (plan_for(context_length, b) for b in batches) if p.total <= limit]
        if fits:
            return fits[0]
        raise _refusal(sizing, context_length, limit, batches, "context_length")
    best: MemoryPlan | None = None
    for batch in batches:
        ctx = _largest_context(sizing, batch, limit, trained)
        if ctx and (best is None or ctx > best.context_length):
            best = plan_for(ctx, batch)
    if best is None or best.context_length < min(MIN_CONTEXT, trained):
        raise _refusal(sizing, min(MIN_CONTEXT, trained), limit, batches, "budget")
    return best


def _auto(
    sizing: _Sizing, context_length: int | None, limit: int, batches: tuple[int, ...]
) -> MemoryPlan:
    """parallel="auto": the most slots, up to AUTO_MAX_PARALLEL, whose plan fits ``limit``
    with a useful context each (``context_length`` if given, else AUTO_MIN_CONTEXT or the
    trained context if shorter); one slot, planned as usual, when no more fit."""
    trained = sizing.shape.trained_context
    useful = context_length or (min(AUTO_MIN_CONTEXT, trained) if trained > 0 else MIN_CONTEXT)
    for n in range(AUTO_MAX_PARALLEL, 1, -1):
        try:
            plan = _fit(sizing.with_slots(n), context_length, limit, batches)
        except MemoryBudgetError:
            continue
        if plan.context_length >= useful:
            return plan
    return _fit(sizing.with_slots(1), context_length, limit, batches)


def _largest_context(sizing: _Sizing, batch: int, limit: int, trained: int) -> int:
    """The largest context (a multiple of 256, or the trained context) that fits ``limit``."""
    plan_for = sizing.plan
    if plan_for(trained, batch).total <= limit:
        return trained
    lo, hi = 0, math.ceil(trained / _CONTEXT_STEP)
    while lo < hi:  # largest k with plan(k * step) within the limit
        mid = (lo + hi + 1) // 2
        if plan_for(mid * _CONTEXT_STEP, batch).total <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo * _CONTEXT_STEP


def _refusal(
    sizing: _Sizing, ctx: int, limit: int, batches: tuple[int, ...], cause: str
) -> MemoryBudgetError:
    """The plan for ``ctx`` does not fit ``limit``: say what it needs, part by part (their
    figures add up to the total), and what would fit."""
    plan = sizing.plan(ctx, batches[-1])
    slots = plan.parallel
    fewer = next(
        (n for n in range(slots - 1, 0, -1)
         if sizing.with_slots(n).plan(ctx, batches[-1]).total <= limit),
        None,
    )  # fmt: skip
    advice = ["a bigger memory_budget", "a smaller quantization (a smaller model file)"]
    if cause == "context_length":
        advice.insert(0, "a shorter context_length")
    if plan.draft:
        advice.append("a smaller draft model or none (speculative='auto': prompt lookup)")
    if fewer is not None:
        advice.insert(0, f"parallel={fewer} (the most slots of {ctx} tokens this budget holds)")
    before = (
        f"{mb(plan.loaded)} resident once the weights were loaded (measured)"
        if plan.loaded is not None
        else f"weights {mb(plan.weights)}"
    )
    overhead = (
        f"headroom {mb(plan.headroom)}"
        if plan.loaded is not None
        else f"process {mb(plan.process)}, engine {mb(plan.engine)}, headroom {mb(plan.headroom)}"
    )
    what = f"a {ctx}-token context" if slots == 1 else f"{slots} slots of a {ctx}-token context"
    per_slot = f"; each slot's KV cache is {mb(plan.kv_per_slot)}" if slots > 1 else ""
    return MemoryBudgetError(
        f"the model needs {mb(plan.total)} with {what} but the budget is {mb(plan.budget)} "
        f"({plan.budget_source}): {before}, KV cache {mb(plan.kv_cache)} ({slots_text(plan)}), "
        f"compute {mb(plan.compute)} (activations of {step_text(plan)}, {plan.threads} threads), "
        f"runtime overhead: {overhead}{per_slot}{draft_text(plan)}; use {_either(advice)}"
    )


def _either(options: list[str]) -> str:
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + ", or " + options[-1]


# -- measured at load ----------------------------------------------------------------------


class FitAtLoad:
    """Re-fits a plan to the resident set measured once the engine holds the weights.

    What an engine makes of the weights depends on the CPU it runs on (llama.cpp repacks
    some quantizations for AVX2/NEON/AMX kernels, onnxruntime's MLAS pre-packs int8 weights
    per instruction set), so the plan's weight and engine terms are estimates. A backend calls
    this (through ``LoadConfig.context_for``) after loading the weights and before sizing the
    KV cache: the measured resident set replaces the estimate and the context is fitted again
    (the prefill batch is kept). An explicit context that no longer fits, or a load whose peak
    already passed the budget, raises ``MemoryBudgetError``. ``plan`` is the plan in force.
    """

    def __init__(
        self,
        shape: ModelShape,
        plan: MemoryPlan,
        *,
        fixed_context: bool,
        draft: ModelShape | None = None,
    ) -> None:
        self._shape = shape
        self._fixed_context = fixed_context
        self._draft = draft  # a draft model's shape: still planned, loaded after the target
        self.plan = plan

    def __call__(self, trained: int) -> int:
        plan = self.plan
        loaded = resident_with_mapped_files(self._shape.files)
        if loaded is None:  # no /proc: keep the estimate
            return plan.context_length
        load_peak = peak_rss()
        if load_peak > plan.budget:
            raise MemoryBudgetError(
                f"loading the model took {mb(load_peak)} at its peak, over the budget of "
                f"{mb(plan.budget)} ({plan.budget_source}); use a bigger memory_budget or a "
                "smaller quantization (a smaller model file)"
            )
        shape = self._shape
        if trained > 0 and (shape.trained_context <= 0 or trained < shape.trained_context):
            shape = dataclasses.replace(shape, trained_context=trained)
        fitted = plan_memory(
            shape,
            budget=plan.budget,
            context_length=plan.context_length if self._fixed_context else None,
            process=plan.process,
            engine_loaded=True,
            threads=plan.threads,
            loaded=loaded,
            batches=(plan.batch_size,),
            parallel=plan.parallel,
            draft=self._draft,
        )
        self.plan = dataclasses.replace(fitted, budget_source=plan.budget_source)
        logger.debug(
            "resident once the weights were loaded: %s (estimated %s); context %d -> %d",
            mb(loaded),
            mb(plan.resident_before_kv),
            plan.context_length,
            self.plan.context_length,
        )
        return self.plan.context_length
