"""The KV cache of the ONNX backend's sequence slots, and how one batched step is laid over it.

One buffer per cache tensor, [n_slots, kv_heads, n_ctx, head_dim]: slot s is row s. A run
over one slot binds its row as a [1, ...] tensor at its offset; a batched step binds the rows
from the lowest listed slot to the highest as one [n, ...] tensor, past and present the same
memory, so GroupQueryAttention reads and writes each row in place at the length its mask row
gives it (``seqlens_k``; the rotary positions follow from it too).

On CPUs where onnxruntime's 4-bit ``MatMulNBits`` computes a one-row product with another
kernel (AVX2: a dedicated M=1 kernel) than a product of two or more rows, whose rows agree bit
for bit whatever their number, a step never carries one row alone: a lone slot's step spans
one more row (a neighbour slot's, or at one slot a spare row that no sequence uses), and a
sequence gives the same tokens alone as beside any others. The backend probes this at load.

Rows inside that span whose slots are not in the step (idle rows) ride along as padding: each
gets one token at position 0 (mask row [1, 0, ...]), so it attends to itself only and writes
only its entry 0, which is saved before the run and put back after (unless the slot is empty).
An idle slot's cache [0, slot_past) is therefore unchanged whatever its length, a full slot
included; the price is one row of matrix work per idle row in the span (an engine that fills
the lowest free slot first keeps the span to the busy rows). Copying the listed rows' caches
into a [k, ...] scratch buffer instead would move every cached entry of every row each step.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.errors import InvalidRequestError

from .base import check_fits, check_slot

__all__ = ["WHOLE_CACHE_LIMIT", "SlotCache", "Step", "plan_step", "untouched_zeros"]

# The largest cache held in numpy's arrays, as before untouched pages (resident whole from the
# first token where the kernel backs them with huge pages, which costs little at this size):
# one stream's float32 cache of the default model up to about 2,800 positions. Above it,
# untouched pages held one 8,192-token stream in 0.55x the peak and 8 streams at 2,048 in
# 0.39x (results/kv_pages.json); their decode rate moved either way between runs.
WHOLE_CACHE_LIMIT = 128 * 1024 * 1024


class SlotCache:
    """One zeroed buffer per cache tensor (past and present bound to the same memory), one
    row per slot. A cache larger than ``WHOLE_CACHE_LIMIT`` takes pages only as its entries
    are written (``untouched_zeros``); a smaller one is numpy's, resident whole from its first
    token where the kernel gives it huge pages (benchmarks/kv_pages.py)."""

    def __init__(
        self, past_names: list[str], n_slots: int, row: tuple[int, int, int], dtype: Any
    ) -> None:
        self._pairs = [(n, n.replace("past_key_values", "present")) for n in past_names]
        shape = (n_slots, *row)
        total = len(past_names) * int(np.prod(shape)) * np.dtype(dtype).itemsize
        zeros = np.zeros if total <= WHOLE_CACHE_LIMIT else untouched_zeros
        self.arrays = [zeros(shape, dtype) for _ in past_names]
        self._row_shape = list(row)
        self._row_bytes = self.arrays[0][0].nbytes
        self._dtype = self.arrays[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def bind(self, binding: Any, row: int, n: int) -> None:
        """Binds rows ``row .. row + n - 1`` of every tensor as past and present."""
        shape = [n, *self._row_shape]
        offset = row * self._row_bytes
        for (past, present), array in zip(self._pairs, self.arrays, strict=True):
            ptr = array.ctypes.data + offset
            binding.bind_input(past, "cpu", 0, self._dtype, shape, ptr)
            binding.bind_output(present, "cpu", 0, self._dtype, shape, ptr)

    def save_first(self, rows: list[int]) -> list[np.ndarray]:
        """Entry 0 of ``rows`` in every tensor (copies)."""
        return [a[rows, :, 0, :] for a in self.arrays]

    def restore_first(self, rows: list[int], saved: list[np.ndarray]) -> None:
        for array, values in zip(self.arrays, saved, strict=True):
            array[rows, :, 0, :] = values


def untouched_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed array whose memory becomes resident only where it is written: an anonymous
    mapping, page-aligned, kept out of transparent huge pages. numpy asks for huge pages on
    large arrays, and with them a cache tensor's first token makes 2 MiB resident per head
    (a head's row at 8,192 positions is 2 MiB): the whole cache, at once."""
    count = int(np.prod(shape))
    # private where the platform says so: a forked child writes its own copy, never this
    # process's cache (Windows' anonymous mappings are the process's own already)
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    buffer = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1), **private)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)  # also where the kernel uses them unasked
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)


@dataclass(frozen=True)
class Step:
    """One batched step over the rows ``row .. row + n - 1``: the graph's inputs, the idle
    rows to save and restore, and which output row answers each listed step."""

    row: int
    ids: np.ndarray  # int64 [n, 1]
    mask: np.ndarray  # int64 [n, T]: row i holds its slot's past + 1 ones, then zeros
    positions: np.ndarray  # int64 [n, 1]: each new token's position
    lengths: dict[int, int]  # slot -> its past after the step
    saved_rows: list[int]  # idle rows whose entry 0 holds a cached token
    order: list[int] | None  # output row of steps[i]; None when it is i


def plan_step(
    steps: Sequence[tuple[int, int]],
    pasts: list[int],
    n_ctx: int,
    n_vocab: int,
    rows: int | None = None,
) -> Step:
    """The batched step appending token t to slot s for each (s, t) in ``steps``; every
    request is checked before anything runs (InvalidRequestError). ``rows``: the cache's rows
    (the slots, or the slots and a spare row), given where a lone step is paired: the step
    then spans at least two rows."""
    if len(steps) == 0:
        raise InvalidRequestError("decode_many needs at least one (slot, token) step")
    tokens: dict[int, int] = {}
    for entry in steps:
        slot, token = _pair(entry, n_vocab)
        check_slot(slot, len(pasts))
        if slot in tokens:
            raise InvalidRequestError(f"slot {slot} is listed twice in one decode_many step")
        (tokens[slot],) = check_fits([token], pasts[slot], n_ctx)
    first, last = min(tokens), max(tokens)
    if rows is not None and first == last:
        last = first + 1 if first + 1 < rows else first - 1  # never one row alone
        first, last = min(first, last), max(first, last)
    n = last - first + 1
    ids = np.zeros((n, 1), np.int64)
    positions = np.zeros((n, 1), np.int64)
    for slot, token in tokens.items():
        ids[slot - first, 0] = token
        positions[slot - first, 0] = pasts[slot]
    lengths = positions[:, 0] + 1  # idle rows: one token at position 0
    mask = (np.arange(int(lengths.max()))[None, :] < lengths[:, None]).astype(np.int64)
    idle = [r for r in range(first, last + 1) if r not in tokens and r < len(pasts) and pasts[r]]
    order = [s - first for s, _ in steps]  # the rows asked for, in their order
    return Step(
        row=first,
        ids=ids,
        mask=mask,
        positions=positions,
        lengths={s: pasts[s] + 1 for s in tokens},
        saved_rows=idle,
        order=None if order == list(range(n)) else order,
    )


def _pair(entry: Any, n_vocab: int) -> tuple[Any, int]:
    try:
        slot, token = entry
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"decode_many takes (slot, token) pairs, not {entry!r:.60}"
        ) from None
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
        raise InvalidRequestError(f"token {token!r:.40} is not a token id")
    if not 0 <= token < n_vocab:
        raise InvalidRequestError(f"token id {token} is outside the vocabulary of {n_vocab}")
    return slot, int(token)
