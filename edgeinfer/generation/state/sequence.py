"""One sequence's KV snapshot for a loaded model: capture, write, read back into a slot.

The backend's part (what its KV layout is, how many bytes n tokens take, how to copy a slot
out and in) is the ``KVState`` the backend hands out (``runtimes.base``: ``kv_state()``);
this module ties it to the snapshot file and the model's fingerprint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeinfer.errors import SnapshotError

from .fingerprint import fingerprint
from .snapshot import Header, PayloadReader, open_snapshot, read_header, write_snapshot

if TYPE_CHECKING:
    from edgeinfer.runtimes.base import KVState

__all__ = ["Capture", "SeqStates", "kv_state_of"]


def kv_state_of(backend: Any) -> KVState | None:
    """``backend``'s KV state (``SlotBackend.kv_state``); None for a backend without one."""
    kv_state = getattr(backend, "kv_state", None)
    return kv_state() if callable(kv_state) else None


@dataclass(frozen=True)
class Capture:
    """A copy of one slot's tokens and KV, ready to be written (by any thread)."""

    tokens: tuple[int, ...]
    reusable: int
    parts: Sequence[Any]  # buffers: the payload in order

    @property
    def nbytes(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)


class SeqStates:
    """Snapshots of ``backend``'s sequences, fingerprinted for ``model_path``."""

    def __init__(self, backend: Any, model_path: Path) -> None:
        kv = kv_state_of(backend)
        if kv is None:
            raise SnapshotError("this model's backend cannot save or restore its KV cache")
        self._kv = kv
        self._backend = backend
        self._model_path = model_path
        self._fingerprint: dict[str, Any] | None = None

    @property
    def fingerprint(self) -> dict[str, Any]:
        if self._fingerprint is None:
            layout = self._kv.layout()
            self._fingerprint = fingerprint(self._model_path, self._backend.info, layout)
        return self._fingerprint

    def payload_band(self, n_tokens: int) -> tuple[int, int]:
        return self._kv.payload_band(n_tokens)

    def capture(self, slot: int, tokens: Sequence[int], reusable: int) -> Capture:
        """Copy slot ``slot``'s KV, which holds ``tokens``."""
        return Capture(tuple(tokens), reusable, self._kv.save(slot))

    def write(self, path: Path, capture: Capture) -> int:
        """Write ``capture`` to ``path`` atomically; the file's size."""
        return write_snapshot(
            path, self.fingerprint, capture.tokens, capture.reusable, capture.parts
        )

    @property
    def whole_only(self) -> bool:
        """Whether a restored snapshot can only be reused whole (llama.cpp, sliding-window
        layers): it is then cut at the reuse granule when saved."""
        return bool(self._kv.whole_only)

    @property
    def copies_on_restore(self) -> bool:
        """Whether a restore holds a second copy of the KV in memory while it reads (llama.cpp
        takes the state as one buffer; the ONNX cache is read in place)."""
        return bool(self._kv.copies_on_restore)

    def check_fingerprint(self, theirs: dict[str, Any], path: Path) -> None:
        """SnapshotError naming what differs (the file's value and this machine's) when
        ``theirs`` is not this model's on this machine and engine."""
        ours = self.fingerprint
        if theirs.get("model_sha256") != ours["model_sha256"]:
            raise SnapshotError(
                f"{path} was made by another model (its sha256 differs: the file's "
                f"{str(theirs.get('model_sha256'))[:12]!r}, this model's "
                f"{ours['model_sha256'][:12]!r}); it restores only onto the same weights"
            )
        for key in ours:
            if key not in ("model_sha256", "layout") and theirs.get(key) != ours[key]:
                raise SnapshotError(
                    f"{path} was made with another {key}: the file's {theirs.get(key)!r:.200}, "
                    f"this machine's {ours[key]!r:.200}; its KV would not be the numbers this "
                    "machine computes — make it again here"
                )
        layout = theirs.get("layout")
        if layout != ours["layout"]:
            diff = _differences(layout, ours["layout"])
            raise SnapshotError(f"{path} was made with other settings ({diff}); make it again")

    def check(self, header: Header, path: Path) -> None:
        """SnapshotError naming what differs when ``header`` is not this model's snapshot."""
        self.check_fingerprint(header.fingerprint, path)
        if len(header.tokens) > self._backend.n_ctx:
            raise SnapshotError(f"{path} holds more tokens than this model's context")
        low, high = self.payload_band(len(header.tokens))
        if not low <= header.payload_bytes <= high:
            raise SnapshotError(
                f"{path}: {header.payload_bytes} bytes of KV cannot be {len(header.tokens)} "
                "tokens of this model's KV; the file was changed"
            )

    def read_header(self, path: Path) -> tuple[int, Header]:
        """An open descriptor of ``path`` and its header, checked against this model."""
        fd = open_snapshot(path)
        try:
            header = read_header(fd, path)
            self.check(header, path)
        except BaseException:
            os.close(fd)
            raise
        return fd, header

    def restore(
        self, path: Path, slot: int, accept: Callable[[Header], None] | None = None
    ) -> Header:
        """Read the snapshot at ``path`` into slot ``slot`` (left empty on any failure);
        ``accept`` may refuse the header (raise) before the KV is read."""
        fd, header = self.read_header(path)
        try:
            if accept is not None:
                accept(header)
            reader = PayloadReader(fd, header, path)
            try:
                n = len(header.tokens)
                self._kv.load(slot, n, header.payload_bytes, reader)
                reader.verify()
            except BaseException:
                self._backend.rewind(0, slot)
                raise
        finally:
            os.close(fd)
        return header


def _differences(theirs: Any, ours: dict[str, Any]) -> str:
    if not isinstance(theirs, dict):
        return "no layout"
    keys = sorted(set(theirs) | set(ours))
    return ", ".join(
        f"{k} {theirs.get(k)!r} vs {ours.get(k)!r}" for k in keys if theirs.get(k) != ours.get(k)
    )
