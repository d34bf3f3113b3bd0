"""A slot backend's sequences seen one at a time: ``SlotView`` (one slot as a plain
single-sequence backend, what ``KVHistory``, ``slide``, the prompt cache and speculative
decoding drive), ``OneSlot`` (a plain backend seen as a slot backend of one slot, so the
generation loop drives every backend the same way) and ``slide`` (room made in a full
cache)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .generation import KVHistory

if TYPE_CHECKING:
    from .runtimes.base import Backend, SlotBackend

__all__ = ["OneSlot", "SlotView", "slide"]


class OneSlot:
    """A plain ``Backend`` (one sequence, no slot argument) seen as a slot backend of one
    slot, so the engine drives it as it drives any other."""

    n_slots = 1

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.tokenizer = backend.tokenizer

    @property
    def n_ctx(self) -> int:
        return self._backend.n_ctx

    @property
    def reuse_is_exact(self) -> bool:
        return self._backend.reuse_is_exact

    def slot_past(self, slot: int) -> int:
        return self._backend.n_past

    def prefill(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        return self._backend.prefill(token_ids)

    def decode(self, token_id: int, slot: int = 0) -> np.ndarray:
        return self._backend.decode(token_id)

    def forward(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        return self._backend.forward(token_ids)  # type: ignore[attr-defined]

    def rewind(self, n: int, slot: int = 0) -> None:
        self._backend.rewind(n)

    def decode_many(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        ((_, token),) = steps
        return self._backend.decode(token)[None, :]


class SlotView:
    """One slot of a slot backend seen as a single-sequence backend (what ``KVHistory``,
    ``slide``, the prompt cache and speculative decoding drive)."""

    def __init__(self, backend: SlotBackend, slot: int) -> None:
        self._backend = backend
        self.slot = slot
        self.tokenizer = backend.tokenizer

    @property
    def n_ctx(self) -> int:
        return self._backend.n_ctx

    @property
    def n_past(self) -> int:
        return self._backend.slot_past(self.slot)

    @property
    def reuse_is_exact(self) -> bool:
        return self._backend.reuse_is_exact

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        return self._backend.prefill(token_ids, self.slot)

    def decode(self, token_id: int) -> np.ndarray:
        return self._backend.decode(token_id, self.slot)

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        return self._backend.forward(token_ids, self.slot)  # type: ignore[attr-defined]

    def rewind(self, n: int) -> None:
        self._backend.rewind(n, self.slot)


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
