"""``Model.save_state`` / ``Model.load_state``: the current sequence's tokens and KV in a file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeinfer.errors import InvalidRequestError, SnapshotError
from edgeinfer.generation.results import REUSE_GRANULE

from .sequence import SeqStates

if TYPE_CHECKING:
    from edgeinfer.generation.results import KVHistory

__all__ = ["load_state", "save_state"]


def _path(path: str | os.PathLike[str], what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise InvalidRequestError(f"{what}() takes a file path, not {path!r:.60}")
    return Path(path)


def save_state(
    states: SeqStates,
    backend: Any,
    history: KVHistory,
    path: str | os.PathLike[str],
    slot: int = 0,
) -> int:
    """Write ``slot``'s tokens and KV to ``path`` (atomically); the file's size in bytes."""
    target = _path(path, "save_state")
    if not history.tokens:
        raise InvalidRequestError("save_state(): the model holds no sequence yet; generate first")
    if target.is_dir():
        raise SnapshotError(f"cannot write the snapshot {target}: it is a folder")
    past = backend.slot_past(slot)
    n = min(len(history.tokens), past)
    if states.whole_only:  # reused whole only: cut where a longer prompt's reuse would end
        n = min(n, history.batched)
        n -= n % REUSE_GRANULE
        if n == 0:
            raise InvalidRequestError(
                f"save_state(): this model's snapshot holds whole multiples of {REUSE_GRANULE} "
                "prompt tokens; generate from a longer prompt first"
            )
        del history.tokens[n:]
        history.batched = min(history.batched, n)
    if past > n:  # entries past the tokens (an interrupted decode, a cut): dropped
        backend.rewind(n, slot)
    capture = states.capture(slot, history.tokens[:n], min(history.batched, n))
    return states.write(target, capture)


def load_state(
    states: SeqStates, backend: Any, history: KVHistory, path: str | os.PathLike[str], slot: int = 0
) -> list[int]:
    """Read ``path`` into ``slot`` and make ``history`` its tokens; the tokens. A file that is
    not this model's snapshot raises SnapshotError (the sequence is then empty)."""
    source = _path(path, "load_state")
    history.tokens, history.batched = [], 0
    header = states.restore(source, slot)
    history.tokens = list(header.tokens)
    history.batched = header.reusable
    history.whole = len(header.tokens) if states.whole_only else 0
    return list(header.tokens)
