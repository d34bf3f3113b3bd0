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
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from .errors import InvalidRequestError, MemoryBudgetError
from .model_shape import ModelShape
from .rss import peak_rss, resident_with_mapped_files

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "MIN_CONTEXT",
    "FitAtLoad",
    "MemoryPlan",
    "parse_size",
    "plan_memory",
]

MiB = 2**20
DEFAULT_BUDGET_FRACTION = 0.5  # of the RAM available now, when no budget is given
MIN_CONTEXT = 256  # tokens: a smaller plan is refused rather than offered
_CONTEXT_STEP = 256
_BATCHES = (512, 256, 128, 64, 32)  # prefill batch sizes tried, largest first
# The margin (headroom) kept on top of every plan; why these figures: see "Margin" above.
_HEADROOM = 4 * MiB
_HEADROOM_FRACTION = 0.02  # of the planned total
_GROWTH_MARGIN_FRACTION = 0.05  # of what grows after the load (KV cache, compute, threads)
THREAD_BYTES = 2 * MiB  # per compute thread (see "Margin")

# A fresh `python -c "import edgeinfer"` (Python, numpy, psutil, edgeinfer): used when
# planning for another machine's inventory, where this process's own size means nothing.
FRESH_PROCESS_BYTES = 36 * MiB


@dataclass(frozen=True)
class _EngineCosts:
    import_bytes: int  # the engine's libraries and Python modules once imported
    fixed_bytes: int  # per loaded model, besides weights, KV and compute
    vocab_bytes: float  # per vocabulary entry (llama.cpp's vocab; tokenizer tables)
    tokenizer_file_factor: float  # resident bytes per byte of tokenizer.json (ONNX)
    kv_factor: (
        float  # resident bytes per KV cache byte: cache instances alive in a step + workspace
    )
    score_bytes: float  # per (batch x context x attention head): scores and softmax
    compute_fixed_bytes: int  # per model: activations, logits of the last position
    thread_bytes: int  # per compute thread: stack, allocator arena, kernel scratch
    logits_per_batch_token: int  # bytes of logits computed per prefill token (x vocab)
    weight_factor: dict[str, float]  # resident weights / bytes on disk, per quantization


_COSTS = {
    # llama.cpp, CPU: libllama/libggml 9 MiB; vocab structures ~18 MiB for 49k tokens; the
    # compute buffer's touched part fits 5.6 B x batch x context x heads + 8 MiB (measured
    # at contexts 256..8192 and batches 64..512); logits only for the last position.
    "gguf": _EngineCosts(
        import_bytes=10 * MiB,
        fixed_bytes=12 * MiB,
        vocab_bytes=120,
        tokenizer_file_factor=0.0,
        kv_factor=1.0,
        score_bytes=5.8,
        compute_fixed_bytes=11 * MiB,
        thread_bytes=THREAD_BYTES,
        logits_per_batch_token=0,
        weight_factor={"default": 1.0},
    ),
    # onnxruntime, CPU: onnxruntime + tokenizers 22 MiB; the tokenizers library holds ~7x the
    # size of tokenizer.json; optimum's graph returns the grown cache beside the old one and
    # computes logits for every prefill position. Measured on the default model's int8
    # conversion, resident memory grows by 2.75x the KV cache per token of context (two cache
    # instances during a step, plus attention workspace and arena slack); weight residency per
    # quantization measured after session creation (pre-packing copies some weights). int8:
    # 1.55 counts the mapped fp32 embedding (113 MB, read row by row as tokens appear) in full
    # besides the pre-packed int8 weights (measured at load with FitAtLoad's accounting).
    "onnx": _EngineCosts(
        import_bytes=22 * MiB,
        fixed_bytes=8 * MiB,
        vocab_bytes=0,
        tokenizer_file_factor=7.0,
        kv_factor=2.75,
        score_bytes=8.0,
        compute_fixed_bytes=8 * MiB,
        thread_bytes=THREAD_BYTES,
        # the graph's [batch, vocab] fp32 logits in the arena, plus the numpy copy of the
        # previous prefill chunk's, alive while the next chunk runs (measured: +100 MB at
        # batch 512 with a 49k vocabulary)
        logits_per_batch_token=8,
        weight_factor={"fp32": 1.05, "fp16": 1.05, "int8": 1.55, "int4": 1.05, "int8wo": 0.75,
                       "default": 1.2},
    ),
}  # fmt: skip
# onnxruntime on a graph with one preallocated KV buffer written in place (GroupQueryAttention,
# the native builder's graphs) that returns the last position's logits only. Measured with
# `python benchmarks/bench_memory.py --model <native folder> --budgets 512MB 768MB 1GB` on the
# default model: peak - at load - KV = 46 / 49 / 62 MB at (context, batch) 1280/64, 2048/256,
# 2048/512, so no second cache instance and no per-token logits; onnxruntime pre-packs the
# MatMulNBits weights beside the mapped file (at load: 1.6x the weight file).
_COSTS["onnx-shared"] = dataclasses.replace(
    _COSTS["onnx"],
    kv_factor=1.0,
    score_bytes=2.0,
    compute_fixed_bytes=40 * MiB,
    logits_per_batch_token=0,
    weight_factor={"gguf-blocks": 1.6, "default": 1.6},
)

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

    @property
    def kv_cache(self) -> int:
        return int(self.kv_bytes_per_token * self.kv_factor * self.context_length)

    @property
    def resident_before_kv(self) -> int:
        """What is resident before the KV cache: measured at load, else estimated."""
        if self.loaded is not None:
            return self.loaded
        return self.process + self.weights + self.engine

    @property
    def total(self) -> int:
        return self.resident_before_kv + self.kv_cache + self.compute + self.headroom

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv_cache": self.kv_cache, "total": self.total}

    def describe(self) -> str:
        before = (
            f"measured at load {_mb(self.loaded)}"
            if self.loaded is not None
            else f"process {_mb(self.process)}, weights {_mb(self.weights)}, engine "
            f"{_mb(self.engine)}"
        )
        return (
            f"{_mb(self.total)} of {_mb(self.budget)} ({self.budget_source}): {before}, KV "
            f"cache {_mb(self.kv_cache)} ({self.context_length} tokens), compute "
            f"{_mb(self.compute)} (batch {self.batch_size}, {self.threads} threads), headroom "
            f"{_mb(self.headroom)}"
        )


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def plan_memory(
    shape: ModelShape,
    *,
    budget: int | str | None = None,
    context_length: int | None = None,
    available: int | None = None,
    process: int | None = None,
    engine_loaded: bool | None = None,
    threads: int = 1,
    loaded: int | None = None,
    batches: tuple[int, ...] = _BATCHES,
) -> MemoryPlan:
    """Plan ``shape``'s memory within ``budget``; raise ``MemoryBudgetError`` if it cannot fit.

    ``available`` (RAM available now) and ``process`` (this process's resident set) default
    to this machine's; pass a recorded machine's to plan for it. ``threads`` is the number of
    compute threads. ``loaded`` is the resident set measured once the engine holds the
    weights (see ``FitAtLoad``): it then replaces the estimated process, weights and engine.
    """
    costs = _costs_for(shape)
    if process is None:
        process = psutil.Process().memory_info().rss
    if engine_loaded is None:
        engine_loaded = ("llama_cpp" if shape.format == "gguf" else "onnxruntime") in sys.modules
    if not engine_loaded:
        process += costs.import_bytes
    limit, source = _budget(budget, process, available)
    fixed = _fixed_terms(shape, costs, limit, source, process, threads, loaded)
    sizing = _Sizing(costs, shape, fixed)
    return _fit(sizing, context_length, limit, batches)


def _costs_for(shape: ModelShape) -> _EngineCosts:
    """The measured costs of the engine and graph kind that will run ``shape``."""
    costs = _COSTS["onnx-shared" if shape.kv_cache == "shared" else shape.format]
    if shape.kv_cache == "shared" and shape.logits_all_positions:  # onnxruntime-genai's graphs
        costs = dataclasses.replace(
            costs, logits_per_batch_token=_COSTS["onnx"].logits_per_batch_token
        )
    return costs


def _fixed_terms(
    shape: ModelShape, costs: _EngineCosts, limit: int, source: str, process: int,
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

    costs: _EngineCosts
    shape: ModelShape
    fixed: MemoryPlan

    def plan(self, ctx: int, batch: int) -> MemoryPlan:
        """The plan for a ``ctx``-token context read in prefill batches of ``batch`` tokens."""
        batch = min(batch, ctx)
        costs, shape = self.costs, self.shape
        compute = int(
            costs.score_bytes * batch * ctx * shape.n_heads
            + costs.logits_per_batch_token * batch * shape.n_vocab
            + costs.compute_fixed_bytes
            + costs.thread_bytes * self.fixed.threads
        )
        draft = dataclasses.replace(
            self.fixed, context_length=ctx, batch_size=batch, compute=compute
        )
        return dataclasses.replace(draft, headroom=_headroom(draft))


def _budget(budget: int | str | None, process: int, available: int | None) -> tuple[int, str]:
    """The budget in bytes and where it came from."""
    if budget is not None:
        return parse_size(budget), "memory_budget"
    free = psutil.virtual_memory().available if available is None else available
    limit = process + int(free * DEFAULT_BUDGET_FRACTION)
    return limit, f"{DEFAULT_BUDGET_FRACTION:.0%} of the {free / 1e6:.0f} MB available"


def _headroom(draft: MemoryPlan) -> int:
    """The margin on top of ``draft`` (whose headroom is 0): see "Margin" above."""
    growth = draft.kv_cache + draft.compute
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
        raise _refusal(plan_for(context_length, batches[-1]), "context_length")
    best: MemoryPlan | None = None
    for batch in batches:
        ctx = _largest_context(sizing, batch, limit, trained)
        if ctx and (best is None or ctx > best.context_length):
            best = plan_for(ctx, batch)
    if best is None or best.context_length < min(MIN_CONTEXT, trained):
        raise _refusal(plan_for(min(MIN_CONTEXT, trained), batches[-1]), "budget")
    return best


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


def _refusal(plan: MemoryPlan, cause: str) -> MemoryBudgetError:
    needed = plan.total
    advice = (
        "use a shorter context_length, a bigger memory_budget, or a smaller quantization"
        if cause == "context_length"
        else "use a bigger memory_budget or a smaller quantization (a smaller model file)"
    )
    before = (
        f"{_mb(plan.loaded)} resident once the weights were loaded (measured)"
        if plan.loaded is not None
        else f"process {_mb(plan.process)}, weights {_mb(plan.weights)}, engine {_mb(plan.engine)}"
    )
    return MemoryBudgetError(
        f"the model needs {_mb(needed)} with a {plan.context_length}-token context but "
        f"the budget is {_mb(plan.budget)} ({plan.budget_source}): {before}, KV "
        f"cache {_mb(plan.kv_cache)}, compute {_mb(plan.compute)}, headroom "
        f"{_mb(plan.headroom)}; {advice}"
    )


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

    def __init__(self, shape: ModelShape, plan: MemoryPlan, *, fixed_context: bool) -> None:
        self._shape = shape
        self._fixed_context = fixed_context
        self.plan = plan

    def __call__(self, trained: int) -> int:
        plan = self.plan
        loaded = resident_with_mapped_files(self._shape.files)
        if loaded is None:  # no /proc: keep the estimate
            return plan.context_length
        load_peak = peak_rss()
        if load_peak > plan.budget:
            raise MemoryBudgetError(
                f"loading the model took {_mb(load_peak)} at its peak, over the budget of "
                f"{_mb(plan.budget)} ({plan.budget_source}); use a bigger memory_budget or a "
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
        )
        self.plan = dataclasses.replace(fitted, budget_source=plan.budget_source)
        logger.debug(
            "resident once the weights were loaded: %s (estimated %s); context %d -> %d",
            _mb(loaded),
            _mb(plan.resident_before_kv),
            plan.context_length,
            self.plan.context_length,
        )
        return self.plan.context_length
