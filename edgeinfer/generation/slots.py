"""A slot backend's sequences seen one at a time (``SlotView`` and ``OneSlot``, in
``slot_views``, re-exported here), ``slide`` (room made in a full cache) and ``Slot`` (what
the loop keeps of each slot), with the loop's rule for which free slot a request takes
(``slot_for``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .delivery import Submitted
from .results import REUSE_GRANULE, KVHistory, SequenceState, shared_prefix
from .slot_views import OneSlot, SlotView

if TYPE_CHECKING:
    from ..runtimes.base import Backend

__all__ = ["OneSlot", "Slot", "SlotView", "rewind_quietly", "slide", "slot_for", "submitted"]

logger = logging.getLogger(__name__)


def slide(backend: Backend | SlotView, history: KVHistory, token: int, keep: int) -> np.ndarray:
    """Make room in a full cache: keep the first ``keep`` tokens and the newer half of the
    rest, read them again after ``keep``, then ``token``; return ``token``'s logits."""
    window = history.tokens
    keep = min(keep, backend.n_ctx // 2)
    recent = window[keep:][-((backend.n_ctx - keep) // 2) :]
    backend.rewind(keep)
    history.tokens = window[:keep]
    kept_batched = history.batched >= keep
    history.batched = min(history.batched, keep)
    logits = backend.prefill([*recent, token])
    history.tokens += [*recent, token]
    if kept_batched:
        history.batched = len(history.tokens)
    return logits


@dataclass(eq=False)
class Slot:
    """One slot of the loop: its view, KV history, the request it serves and that request's
    sequence state, the prompt left to read and the token the next step appends."""

    view: SlotView
    history: KVHistory = field(default_factory=KVHistory)
    request: Submitted | None = None
    seq: SequenceState | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not read yet
    done: int = 0  # prompt tokens in the cache
    token: int | None = None  # the sampled token the next decode step appends
    remember: int | None = None  # prompt tokens read, for the prompt cache's copy to come

    def free(self) -> None:
        self.request = self.seq = self.token = self.remember = None
        self.pending = []


def submitted(slot: Slot) -> float:
    return slot.request.t_submit if slot.request is not None else 0.0


def slot_for(free: list[Slot], ids: list[int]) -> Slot:
    """The free slot whose cache holds the longest reusable prefix of ``ids``; without one,
    the lowest free slot, so busy slots stay neighbours (backends run a step over a span of
    rows: llama.cpp splits it at every gap, the ONNX graph pads the gaps)."""
    best = max(free, key=lambda s: shared_prefix(s.history.tokens, ids))
    if shared_prefix(best.history.tokens, ids) >= REUSE_GRANULE:
        return best
    return free[0]


def rewind_quietly(view: SlotView, length: int = 0) -> bool:
    """Rewind ``view`` to ``length`` entries where a pass over it has already failed: a second
    failure is logged, not raised (the slot is reset on its next use); False then."""
    try:
        view.rewind(length)
    except Exception:
        logger.debug("could not rewind slot %d", view.slot, exc_info=True)
        return False
    return True
