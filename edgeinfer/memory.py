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

The constants below were measured on the development machine (x86-64, Linux, Python 3.11,
llama-cpp-python 0.3.36, onnxruntime 1.32) with the default model (SmolLM2-135M: GGUF Q4_1
and its ONNX conversions): the per-context and per-batch terms from
``python benchmarks/bench_memory.py --grid`` (contexts 512..8192 x batches 64/512, no budget;
add ``--model DIR`` for an ONNX folder), the fixed terms from the resident set after each
import and load step (``python benchmarks/bench_memory.py --parts [--model DIR]``).
``python benchmarks/bench_memory.py`` checks the plan against the measured peak under
budgets. Other architectures, vocabularies and platforms
were not measured: the weights, KV and score terms scale with the model's own metadata,
the fixed terms do not.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from .errors import InvalidRequestError, MemoryBudgetError

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "MIN_CONTEXT",
    "MemoryPlan",
    "parse_size",
    "peak_rss",
    "plan_memory",
]

MiB = 2**20
DEFAULT_BUDGET_FRACTION = 0.5  # of the RAM available now, when no budget is given
MIN_CONTEXT = 256  # tokens: a smaller plan is refused rather than offered
_CONTEXT_STEP = 256
_BATCHES = (512, 256, 128, 64, 32)  # prefill batch sizes tried, largest first
_HEADROOM = 4 * MiB  # plus 2% of the total: allocator slack and Python objects per request
_HEADROOM_FRACTION = 0.02

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
        logits_per_batch_token=0,
        weight_factor={"default": 1.0},
    ),
    # onnxruntime, CPU: onnxruntime + tokenizers 22 MiB; the tokenizers library holds ~7x the
    # size of tokenizer.json; optimum's graph returns the grown cache beside the old one and
    # computes logits for every prefill position. Measured on the default model's int8
    # conversion, resident memory grows by 2.75x the KV cache per token of context (two cache
    # instances during a step, plus attention workspace and arena slack); weight residency per
    # quantization measured after session creation (pre-packing copies some weights).
    "onnx": _EngineCosts(
        import_bytes=22 * MiB,
        fixed_bytes=8 * MiB,
        vocab_bytes=0,
        tokenizer_file_factor=7.0,
        kv_factor=2.75,
        score_bytes=8.0,
        compute_fixed_bytes=8 * MiB,
        logits_per_batch_token=4,
        weight_factor={"fp32": 1.05, "fp16": 1.05, "int8": 1.1, "int4": 1.05, "int8wo": 0.75,
                       "default": 1.2},
    ),
}  # fmt: skip

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
class ModelShape:
    """What the plan needs to know about a model, read from its metadata."""

    format: str  # "gguf" | "onnx"
    quantization: str
    weight_bytes: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    kv_element_bytes: int
    n_vocab: int
    trained_context: int
    tokenizer_bytes: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return (
            self.n_layers
            * self.n_kv_heads
            * (self.head_dim_k + self.head_dim_v)
            * (self.kv_element_bytes)
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
    compute: int
    headroom: int

    @property
    def kv_cache(self) -> int:
        return int(self.kv_bytes_per_token * self.kv_factor * self.context_length)

    @property
    def total(self) -> int:
        return (
            self.process
            + self.weights
            + self.engine
            + self.kv_cache
            + self.compute
            + (self.headroom)
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv_cache": self.kv_cache, "total": self.total}

    def describe(self) -> str:
        return (
            f"{_mb(self.total)} of {_mb(self.budget)} ({self.budget_source}): process "
            f"{_mb(self.process)}, weights {_mb(self.weights)}, engine {_mb(self.engine)}, KV "
            f"cache {_mb(self.kv_cache)} ({self.context_length} tokens), compute "
            f"{_mb(self.compute)} (batch {self.batch_size}), headroom {_mb(self.headroom)}"
        )


def peak_rss() -> int:
    """The process's peak resident set size in bytes (Linux VmHWM), 0 if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        info = psutil.Process().memory_info()
        peak = getattr(info, "peak_wset", None)  # Windows
        if peak:
            return int(peak)
        import resource

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(maxrss if sys.platform == "darwin" else maxrss * 1024)
    except (ImportError, OSError, psutil.Error):
        return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def shape_of(source: Any) -> ModelShape:
    """The ModelShape of a resolved model (``loader.ModelSource``)."""
    if source.format == "gguf":
        return _gguf_shape(source.header)
    return _onnx_shape(source.path, source.header)


def _gguf_shape(header: Any) -> ModelShape:
    n_head = int(header.arch_value("attention.head_count", 1)) or 1
    n_embd = int(header.arch_value("embedding_length", 0))
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    n_vocab = int(header.arch_value("vocab_size", 0)) or int(getattr(tokens, "length", 0) or 0)
    if not n_vocab and isinstance(tokens, list):
        n_vocab = len(tokens)
    return ModelShape(
        format="gguf",
        quantization="default",
        weight_bytes=max(header.file_size - header.data_offset, header.weight_nbytes),
        n_layers=int(header.arch_value("block_count", 0)),
        n_heads=n_head,
        n_kv_heads=int(header.arch_value("attention.head_count_kv", n_head)),
        head_dim_k=int(header.arch_value("attention.key_length", n_embd // n_head)),
        head_dim_v=int(header.arch_value("attention.value_length", n_embd // n_head)),
        kv_element_bytes=2,  # llama.cpp's default KV cache type: f16
        n_vocab=n_vocab,
        trained_context=int(header.arch_value("context_length", 0)),
    )


def _onnx_shape(folder: Path, manifest: Any) -> ModelShape:
    arch = manifest.architecture
    graph = folder / manifest.model_file
    files = [graph, *folder.glob(manifest.model_file + ".data")]
    weight_bytes = sum(p.stat().st_size for p in files if p.is_file())
    tokenizer = folder / manifest.tokenizer_file
    return ModelShape(
        format="onnx",
        quantization=str(manifest.quantization.get("method", "default")),
        weight_bytes=weight_bytes,
        n_layers=arch.num_layers,
        n_heads=max(1, arch.hidden_size // arch.head_dim) if arch.head_dim else 1,
        n_kv_heads=arch.num_kv_heads,
        head_dim_k=arch.head_dim,
        head_dim_v=arch.head_dim,
        kv_element_bytes=2 if arch.kv_dtype == "float16" else 4,
        n_vocab=arch.vocab_size,
        trained_context=arch.max_context,
        tokenizer_bytes=tokenizer.stat().st_size if tokenizer.is_file() else 0,
    )


def plan_memory(
    shape: ModelShape,
    *,
    budget: int | str | None = None,
    context_length: int | None = None,
    available: int | None = None,
    process: int | None = None,
    engine_loaded: bool | None = None,
) -> MemoryPlan:
    """Plan ``shape``'s memory within ``budget``; raise ``MemoryBudgetError`` if it cannot fit.

    ``available`` (RAM available now) and ``process`` (this process's resident set) default
    to this machine's; pass a recorded machine's to plan for it.
    """
    costs = _COSTS[shape.format]
    if process is None:
        process = psutil.Process().memory_info().rss
    if engine_loaded is None:
        engine_loaded = ("llama_cpp" if shape.format == "gguf" else "onnxruntime") in sys.modules
    if not engine_loaded:
        process += costs.import_bytes
    if budget is None:
        free = psutil.virtual_memory().available if available is None else available
        limit = process + int(free * DEFAULT_BUDGET_FRACTION)
        source = f"{DEFAULT_BUDGET_FRACTION:.0%} of the {free / 1e6:.0f} MB available"
    else:
        limit = parse_size(budget)
        source = "memory_budget"
    factor = costs.weight_factor.get(shape.quantization, costs.weight_factor["default"])
    base = dict(
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
        trained_context=shape.trained_context,
    )

    def plan_for(ctx: int, batch: int) -> MemoryPlan:
        batch = min(batch, ctx)
        compute = int(
            costs.score_bytes * batch * ctx * shape.n_heads
            + costs.logits_per_batch_token * batch * shape.n_vocab
            + costs.compute_fixed_bytes
        )
        draft = MemoryPlan(
            **base, context_length=ctx, batch_size=batch, compute=compute, headroom=0
        )
        headroom = _HEADROOM + int(_HEADROOM_FRACTION * draft.total)
        return MemoryPlan(
            **base, context_length=ctx, batch_size=batch, compute=compute, headroom=headroom
        )

    trained = shape.trained_context if shape.trained_context > 0 else 2**31
    if context_length is not None:
        if context_length > trained:
            raise InvalidRequestError(
                f"context_length={context_length} exceeds the model's trained context "
                f"({trained} tokens); use at most {trained}"
            )
        fits = [p for p in (plan_for(context_length, b) for b in _BATCHES) if p.total <= limit]
        if fits:
            return fits[0]
        raise _refusal(plan_for(context_length, _BATCHES[-1]), "context_length")
    best: MemoryPlan | None = None
    for batch in _BATCHES:
        ctx = _largest_context(plan_for, batch, limit, trained)
        if ctx and (best is None or ctx > best.context_length):
            best = plan_for(ctx, batch)
    if best is None or best.context_length < min(MIN_CONTEXT, trained):
        raise _refusal(plan_for(min(MIN_CONTEXT, trained), _BATCHES[-1]), "budget")
    return best


def _largest_context(plan_for: Any, batch: int, limit: int, trained: int) -> int:
    """The largest context (a multiple of 256, or the trained context) that fits ``limit``."""
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
    return MemoryBudgetError(
        f"the model needs {needed / 1e6:.0f} MB with a {plan.context_length}-token context but "
        f"the budget is {plan.budget / 1e6:.0f} MB ({plan.budget_source}): process "
        f"{_mb(plan.process)}, weights {_mb(plan.weights)}, engine {_mb(plan.engine)}, KV "
        f"cache {_mb(plan.kv_cache)}, compute {_mb(plan.compute)}; {advice}"
    )
