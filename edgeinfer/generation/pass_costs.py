"""What a model's forward passes cost: one-token steps and passes over 1 + k tokens.

Speculative decoding drafts only while the drafts it expects to keep pay for the longer pass
(``speculative.DraftBudget``), so it needs a pass over 1 + k tokens in one-token steps, on this
machine, for this model and engine: on onnxruntime a pass over 9 tokens may cost 3 steps, on
llama.cpp's CPU kernels 7. ``PassCosts.calibrate`` times them on the model itself when it is
loaded with a setting that reads them ("auto", "draft:NAME": a few passes on an empty cache,
which it leaves empty), and every step and pass that runs afterwards refines them (a moving
average). A k never timed is
interpolated between the nearest two that were; before anything is timed a guess stands in.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import EdgeInferError
from .slot_views import SlotView, view_of

if TYPE_CHECKING:
    from ..runtimes.base import Backend

__all__ = ["CALIBRATED_DRAFTS", "PassCosts"]

logger = logging.getLogger(__name__)

CALIBRATED_DRAFTS = (1, 4)  # the k whose passes are timed at load, beside max_draft's
_CALIBRATION_ROUNDS = 2  # timed rounds (after one untimed: each shape's first run is slower)
_CALIBRATION_PROMPT = 16  # tokens in the cache while passes are timed


class Setting(Protocol):
    """What timing at load reads of a speculative setting (``speculative.SpeculativeConfig``)."""

    @property
    def on(self) -> bool: ...

    @property
    def max_draft(self) -> int: ...

    @property
    def adaptive(self) -> bool: ...


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

    @classmethod
    def at_load(cls, backend: Backend, setting: Setting | None) -> PassCosts:
        """A model's pass costs: timed on ``backend`` now (at load, its cache empty) when its
        requests speculate adaptively by default ("auto", "draft:NAME") and it can verify in
        one pass; else learned as they run (a request that asks for it of a model loaded
        without it)."""
        costs = cls()
        if setting is None or not (setting.on and setting.adaptive):
            return costs  # off, or a fixed draft length that never reads the costs
        if getattr(backend, "multi_position_logits", False):
            costs.calibrate(backend, setting.max_draft)
        return costs

    def record_step(self, seconds: float) -> None:
        w = self._weight
        self.step_s = seconds if self.step_s == 0 else (1 - w) * self.step_s + w * seconds

    def record_pass(self, k: int, seconds: float) -> None:
        old = self.pass_s.get(k)
        w = self._weight
        self.pass_s[k] = seconds if old is None else (1 - w) * old + w * seconds

    def ratio(self, k: int) -> float:
        """A pass over 1 + k tokens in one-token steps (never below one)."""
        if self.step_s == 0 or not self.pass_s:
            return _prior(k)
        measured = self.pass_s.get(k)
        if measured is None:
            measured = self._between(k)
        return max(measured / self.step_s, 1.0)

    def _between(self, k: int) -> float:
        """Seconds of a pass over 1 + k tokens, interpolated between the nearest measured
        k (beyond the largest, along the last two's slope; below the smallest, towards a
        step at k = 0)."""
        points = sorted(self.pass_s.items())
        ks = [p[0] for p in points]
        i = bisect.bisect_left(ks, k)
        if i == 0:
            (k1, s1), (k0, s0) = points[0], (0, self.step_s)
        elif i == len(points):
            (k0, s0), (k1, s1) = points[-2] if len(points) > 1 else (0, self.step_s), points[-1]
        else:
            (k0, s0), (k1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) * (k - k0) / (k1 - k0)

    def calibrate(self, backend: Backend, max_draft: int, slot: int = 0) -> None:
        """Time one-token steps and passes over 1 + k tokens (each k of CALIBRATED_DRAFTS up
        to ``max_draft``, and ``max_draft``) on ``slot`` of an empty cache: the fastest of
        a few rounds after an untimed one (a slower one met other work), the rewinds after
        them untimed. The slot is left empty. A pass the engine refuses (longer than it
        reads at once) is left out; anything else that fails leaves the costs to be learned
        as requests run. Logs what it found."""
        ks = sorted({k for k in CALIBRATED_DRAFTS if k < max_draft} | {max_draft})
        vocab = max(backend.tokenizer.n_vocab, 2)
        prompt = [(7 + 13 * i) % vocab for i in range(_CALIBRATION_PROMPT)]
        read = [(11 + 17 * i) % vocab for i in range(max_draft + 1)]  # a pass's tokens
        if backend.n_ctx < len(prompt) + len(read):
            logger.info("speculative decoding: the context is too short to time passes in")
            return
        began = time.perf_counter()
        view = view_of(backend, slot)
        try:
            steps, passes = _timings(view, prompt, read, ks)
        except Exception as exc:  # timing is optional: never the reason a load fails
            logger.warning("speculative decoding: passes could not be timed at load: %s", exc)
            return
        finally:
            _empty(view)
        self.step_s = min(steps)
        self.pass_s.update({k: min(v) for k, v in passes.items() if v})
        logger.info(
            "speculative decoding: a pass over 1 + k tokens costs %s one-token steps of "
            "%.1f ms (timed at load in %.0f ms)",
            ", ".join(f"{self.ratio(k):.2f} (k={k})" for k in sorted(self.pass_s)),
            self.step_s * 1000,
            (time.perf_counter() - began) * 1000,
        )


def _timings(
    view: SlotView, prompt: list[int], read: list[int], ks: list[int]
) -> tuple[list[float], dict[int, list[float]]]:
    """Seconds of one-token steps and of passes over 1 + k tokens after ``prompt``."""
    steps: list[float] = []
    passes: dict[int, list[float]] = {k: [] for k in ks}
    view.rewind(0)
    view.prefill(prompt)
    for r in range(_CALIBRATION_ROUNDS + 1):
        timed = _timed(view, view.decode, read[r % len(read)], len(prompt))
        if r:
            steps.append(timed)
        for k in list(passes):  # a pass the engine refused is gone from it
            try:
                timed = _timed(view, view.forward, read[: k + 1], len(prompt))
            except EdgeInferError:  # longer than the engine reads in one pass
                del passes[k]
                continue
            if r:
                passes[k].append(timed)
    return steps, passes


def _timed(view: SlotView, run: Callable[[Any], object], tokens: Any, base: int) -> float:
    """Seconds of ``run(tokens)`` (a step or a pass); then rewound to ``base``, untimed."""
    start = time.perf_counter()
    try:
        run(tokens)
        return time.perf_counter() - start
    finally:
        view.rewind(base)


def _empty(view: SlotView) -> None:
    """The slot as load() left it; a backend that cannot even rewind is left to the next
    request's own rewind (its history is empty), and said so."""
    try:
        view.rewind(0)
    except Exception as exc:
        logger.warning("speculative decoding: the timed slot could not be emptied: %s", exc)
