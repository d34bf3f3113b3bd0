"""One sequence of a backend, whatever its kind: ``OneSlot`` (a plain backend seen as a slot
backend of one slot, so the generation loop drives every backend the same way) and
``SlotView`` (one slot of a slot backend seen as a plain single-sequence backend, what
``KVHistory``, ``slide``, the prompt cache, speculative decoding and the timing of passes at
load drive). Apart from ``slots`` so that modules it imports can use them too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..runtimes.base import Backend, SlotBackend

__all__ = ["OneSlot", "SlotView", "as_slots", "view_of"]


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


def as_slots(backend: Backend | SlotBackend) -> SlotBackend:
    """``backend`` as a slot backend: itself, or a plain one as a slot backend of one slot."""
    return backend if hasattr(backend, "n_slots") else OneSlot(backend)  # type: ignore[return-value,arg-type]


def view_of(backend: Backend | SlotBackend, slot: int = 0) -> SlotView:
    """``slot`` of ``backend`` (a plain backend has slot 0 only) as a single-sequence view."""
    return SlotView(as_slots(backend), slot)
