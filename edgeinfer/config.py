"""LoadConfig: how a model is opened (device, context length, threads), validated up front."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import InvalidRequestError
from .files.manifest import KV_DTYPES as MANIFEST_KV_DTYPES
from .machine.busy import CpuShare, cpu_share

__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "KV_DTYPES",
    "MAX_PARALLEL",
    "MAX_THREADS",
    "LoadConfig",
    "check_parallel",
]

# Context used when the caller gives none: the model's trained context, capped here so a
# 128k-context model does not reserve a KV cache for 128k tokens by default.
DEFAULT_CONTEXT_LENGTH = 8192
_MIN_CONTEXT_LENGTH = 16
# llama.cpp's own limit (GGML_MAX_N_THREADS); more threads than that crashed the engine.
MAX_THREADS = 512
KV_DTYPES = ("auto", *MANIFEST_KV_DTYPES)  # load(kv_dtype=...): "auto" or a graph's type
MAX_PARALLEL = 256  # sequence slots one model holds at most (load's parallel=, --parallel)


def check_parallel(parallel: object, *, auto: bool = True) -> int:
    """``parallel`` as a slot count (1 to ``MAX_PARALLEL``); InvalidRequestError otherwise."""
    if isinstance(parallel, int) and not isinstance(parallel, bool):
        if 1 <= parallel <= MAX_PARALLEL:
            return parallel
    hint = " or 'auto' (the most slots the memory budget allows)" if auto else ""
    raise InvalidRequestError(
        f"parallel={parallel!r} is invalid: expected an integer from 1 to {MAX_PARALLEL} (the "
        f"sequences generated at once){hint}"
    )


@dataclass(frozen=True)
class LoadConfig:
    device: str = "auto"
    context_length: int | None = None
    threads: int | None = None
    # Flash attention in llama.cpp: faster on CPU here (decode ~+15%), but its sums differ in
    # the last bits, so greedy output can differ from llama.cpp's default (off) at near-ties.
    flash_attention: bool = False
    # The KV cache's element type: "auto" (the model's own: float32 in an ONNX graph unless it
    # was built otherwise, float16 in llama.cpp), "float32" or "float16" (KV_DTYPES).
    kv_dtype: str = "auto"
    # Sequence slots sharing the model and one KV allocation (load(..., parallel=N)); the
    # backend sizes its cache for this many sequences of context_length tokens each.
    parallel: int = 1
    # Prefill batch (llama.cpp n_batch/n_ubatch; ONNX prefill chunk), set by the memory plan.
    batch_size: int | None = None
    # Set by load(): re-fits the context to the memory measured once the weights are loaded
    # (edgeinfer.memory.plan.FitAtLoad); takes the model's trained context, returns the context.
    fit_context: Callable[[int], int] | None = field(default=None, compare=False, repr=False)
    # With threads=None: the CPU share measured the first time threads were resolved (kept
    # by dataclasses.replace, so one load samples once); backends may re-measure it later.
    cpu_share: CpuShare | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device:
            raise InvalidRequestError(f"device={self.device!r} is invalid: expected a name")
        ctx = self.context_length
        if ctx is not None and (
            not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < _MIN_CONTEXT_LENGTH
        ):
            raise InvalidRequestError(
                f"context_length={ctx!r} is invalid: expected None or an integer >= "
                f"{_MIN_CONTEXT_LENGTH}"
            )
        if not isinstance(self.flash_attention, bool):
            raise InvalidRequestError(
                f"flash_attention={self.flash_attention!r} is invalid: expected True or False"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(
                f"kv_dtype={self.kv_dtype!r} is invalid: expected one of {', '.join(KV_DTYPES)}"
            )
        check_parallel(self.parallel)
        threads = self.threads
        if threads is not None and (
            not isinstance(threads, int)
            or isinstance(threads, bool)
            or not 1 <= threads <= MAX_THREADS
        ):
            raise InvalidRequestError(
                f"threads={threads!r} is invalid: expected None or an integer from 1 to "
                f"{MAX_THREADS} (the cores to compute on)"
            )

    @property
    def resolved_threads(self) -> int:
        """Threads to compute with: the caller's number, else the usable cores (physical,
        affinity, container quota) less those other processes keep busy now
        (``machine/busy.py``)."""
        if self.threads is not None:
            return self.threads
        share = self.cpu_share
        if share is None:  # a memo on a frozen config: sampled once, then carried
            share = cpu_share()
            object.__setattr__(self, "cpu_share", share)
        return share.threads

    @property
    def threads_why(self) -> str:
        """Why ``resolved_threads`` is what it is (``model.info["threads_why"]``)."""
        if self.threads is not None:
            return f"threads={self.threads} was asked for"
        return self.cpu_share.why if self.cpu_share is not None else "not resolved yet"

    def context_for(self, trained: int) -> int:
        """The context to size the KV cache for, given the model's trained context.

        A backend calls this once the engine holds the weights and before it sizes the KV
        cache: with ``fit_context`` set, the context is fitted then to the measured memory.
        """
        if self.fit_context is not None:
            return self.fit_context(trained)
        if self.context_length is None:
            return min(trained, DEFAULT_CONTEXT_LENGTH) if trained > 0 else DEFAULT_CONTEXT_LENGTH
        if trained > 0 and self.context_length > trained:
            raise InvalidRequestError(
                f"context_length={self.context_length} exceeds the model's trained context "
                f"({trained} tokens); use at most {trained}"
            )
        return self.context_length
