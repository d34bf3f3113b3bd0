"""The automatic prompt cache: KV snapshots of long prompts in a folder, found again by prefix.

After a request prefills at least ``min_tokens`` new tokens, a copy of its prompt's KV is
taken once the first token is out and written in a background thread (atomically; never
stalling the reply). A later request, in this process or another, whose prompt shares at
least ``min_tokens`` leading tokens with a snapshot (rounded down to the reuse granule, and
more than the KV in memory already holds) has that prefix read from disk and prefills only
the rest. The snapshots it wrote are capped at ``max_bytes``: the least recently used (the
oldest mtime; a restore touches its file) go first.

Files that are not usable snapshots of this model (another model, engine version or settings,
truncated, corrupt, not snapshots, symlinks) are skipped with one warning each and counted in
``stats["ignored_files"]``: never a wrong answer, never a crash.

The cache deletes only what it can prove it wrote: a regular file whose header is a valid
snapshot header (magic, format, checksum, the file's size) and whose name is the hash of that
header's fingerprint and tokens, and its own temporary files (``.<that name>.<pid>.tmp``).
Anything else in the folder (``notes.kvs``, a ``save_state`` file, a symlink) is never deleted
nor counted against ``max_bytes``; ``stats["foreign_files"]`` counts what the last eviction
left alone and ``stats["foreign_names"]`` names some of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeinfer.errors import EdgeInferError, InvalidRequestError, SnapshotError
from edgeinfer.files.catalog import edgeinfer_home
from edgeinfer.generation.results import MIN_REREAD, REUSE_GRANULE, shared_prefix

from .sequence import Capture, SeqStates
from .snapshot import open_snapshot, read_header

if TYPE_CHECKING:
    from edgeinfer.generation.results import KVHistory
    from edgeinfer.runtimes.base import Backend

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MIN_TOKENS", "PromptCache", "default_dir"]

logger = logging.getLogger(__name__)

DEFAULT_MIN_TOKENS = 256  # prompt tokens prefilled before a snapshot is worth its disk read
DEFAULT_MAX_BYTES = 2 << 30
SUFFIX = ".kvs"
_STALE_TMP_S = 3600.0
_OWN_NAME = re.compile(r"[0-9a-f]{40}\.kvs")
_OWN_TMP = re.compile(r"\.[0-9a-f]{40}\.kvs\.[0-9]{1,10}\.tmp")
_NAMES_SHOWN = 16


def default_dir() -> Path:
    return edgeinfer_home() / "prompt-cache"


@dataclass
class _Entry:
    path: Path
    tokens: tuple[int, ...]
    reusable: int
    size: int
    fingerprint: dict[str, Any]
    own: bool = True  # written by a prompt cache (its name is the hash of what it holds)


class PromptCache:
    """A folder of KV snapshots shared by the models that use it (each reads only its own).

    ``load(..., prompt_cache=DIR)`` makes one with the defaults; pass a ``PromptCache`` for
    other limits."""

    def __init__(
        self,
        folder: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        min_tokens: int = DEFAULT_MIN_TOKENS,
    ) -> None:
        for name, value, low in (("max_bytes", max_bytes, 1), ("min_tokens", min_tokens, 32)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(
                    f"{name}={value!r} is invalid: expected an integer >= {low}"
                )
        self.folder = Path(folder) if folder is not None else default_dir()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidRequestError(
                f"prompt_cache={str(self.folder)!r}: cannot create the folder: {exc.strerror}"
            ) from exc
        if not self.folder.is_dir():
            raise InvalidRequestError(f"prompt_cache={str(self.folder)!r} is not a folder")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._seen: dict[str, tuple[int, ...]] = {}  # name -> its stat stamp when read
        self._proved: dict[str, tuple[int, ...]] = {}  # own files: name -> stamp when proved
        self._foreign: list[str] = []
        self._warned: set[str] = set()
        self._writer: threading.Thread | None = None
        self._counts = dict.fromkeys(
            ("hits", "disk_tokens", "writes", "write_failures", "skipped_writes",
             "ignored_files", "restore_failures", "evicted", "foreign_files"), 0)  # fmt: skip

    @classmethod
    def of(cls, value: Any) -> PromptCache | None:
        """``load()``'s ``prompt_cache``: None/False (none), True (the default folder), a
        folder, or a PromptCache."""
        if value is None or value is False:
            return None
        if isinstance(value, PromptCache):
            return value
        if value is True:
            return cls()
        if isinstance(value, (str, os.PathLike)) and str(value):
            return cls(value)
        raise InvalidRequestError(
            f"prompt_cache={value!r} is invalid: expected a folder, True (the default under "
            "$EDGEINFER_HOME) or None"
        )

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "folder": str(self.folder),
                **self._counts,
                "foreign_names": list(self._foreign),
            }

    # -- lookup and restore ---------------------------------------------------------------

    def restore(
        self,
        states: SeqStates,
        backend: Backend,
        history: KVHistory,
        prompt: list[int],
        slot: int = 0,
        budget: int | None = None,
    ) -> int:
        """If a snapshot holds more of ``prompt``'s reusable prefix than the KV does, read it
        into ``slot`` and set ``history`` to it; the prompt tokens it brings (0 if none)."""
        in_memory = _aligned(shared_prefix(history.tokens[: history.batched], prompt), len(prompt))
        best, gain = None, 0
        for entry in self._scan(states):
            n = _aligned(shared_prefix(entry.tokens[: entry.reusable], prompt), len(prompt))
            if n >= self.min_tokens and n > max(in_memory, gain):
                best, gain = entry, n
        if best is None:
            return 0
        if not self._fits_budget(budget, best.size if states.copies_on_restore else 0):
            return 0
        try:
            header = states.restore(best.path, slot)
        except SnapshotError as exc:
            self._ignore(best.path.name, exc, "restore_failures")
            history.tokens, history.batched = [], 0
            return 0
        history.tokens = list(header.tokens)
        history.batched = header.reusable
        if best.own:
            _touch(best.path)  # the least recently used go first
        with self._lock:
            self._counts["hits"] += 1
            self._counts["disk_tokens"] += gain
        logger.debug("prompt cache: %d tokens from %s", gain, best.path.name)
        return gain

    def _fits_budget(self, budget: int | None, nbytes: int) -> bool:
        """Whether reading ``nbytes`` more keeps the process within the memory budget."""
        if budget is None:
            return True
        import psutil

        if psutil.Process().memory_info().rss + nbytes <= budget:
            return True
        logger.warning(
            "prompt cache: a %d-byte snapshot does not fit the memory budget now; skipped", nbytes
        )
        return False

    def _scan(self, states: SeqStates) -> list[_Entry]:
        """This model's snapshots in the folder (headers read once per file version)."""
        with self._lock:
            return self._scan_locked(states)

    def _scan_locked(self, states: SeqStates) -> list[_Entry]:
        try:
            listing = list(os.scandir(self.folder))
        except OSError as exc:
            logger.warning("prompt cache: cannot list %s: %s", self.folder, exc)
            return []
        present = set()
        for item in listing:
            if not item.name.endswith(SUFFIX) or item.name.startswith("."):
                continue
            present.add(item.name)
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            stamp = _stamp(st)
            if self._seen.get(item.name) == stamp:
                continue
            self._seen[item.name] = stamp
            self._entries.pop(item.name, None)
            entry = self._read_entry(Path(item.path))
            if entry is not None:
                self._entries[item.name] = entry
        for name in list(self._entries):
            if name not in present:
                del self._entries[name]
                self._seen.pop(name, None)
        found = []
        for entry in self._entries.values():
            try:
                states.check_fingerprint(entry.fingerprint, entry.path)
            except SnapshotError as exc:
                self._ignore(entry.path.name, exc)
                continue
            found.append(entry)
        return found

    def _read_entry(self, path: Path) -> _Entry | None:
        try:
            fd = open_snapshot(path)
            try:
                header = read_header(fd, path)
            finally:
                os.close(fd)
        except SnapshotError as exc:
            self._ignore(path.name, exc)
            return None
        size = header.payload_offset + header.payload_bytes
        own = path.name == _name(header.fingerprint, list(header.tokens))
        return _Entry(path, header.tokens, header.reusable, size, header.fingerprint, own)

    def _ignore(self, name: str, exc: Exception, counter: str = "ignored_files") -> None:
        with self._lock:
            first = name not in self._warned
            self._warned.add(name)
            if first or counter != "ignored_files":  # a file is counted once
                self._counts[counter] += 1
        if first:
            logger.warning("prompt cache: ignoring %s", exc)

    # -- remember -------------------------------------------------------------------------

    def remember(self, states: SeqStates, prompt: list[int], prefilled: int, slot: int = 0) -> None:
        """After a prefill of ``prefilled`` new tokens of ``prompt`` (the slot holds exactly
        ``prompt``): copy its KV and write it in the background, if worth it."""
        if prefilled < self.min_tokens or len(prompt) < self.min_tokens:
            return
        n = len(prompt) - len(prompt) % REUSE_GRANULE  # the most a longer prompt can reuse of it
        with self._lock:
            entries = [e for e in self._entries.values() if e.fingerprint == states.fingerprint]
        if any(shared_prefix(e.tokens[: e.reusable], prompt) >= n for e in entries):
            return  # a snapshot already holds as much of it as can be reused
        with self._lock:
            if self._writer is not None and self._writer.is_alive():
                self._counts["skipped_writes"] += 1
                return
        try:
            capture = states.capture(slot, prompt, len(prompt))
        except (EdgeInferError, MemoryError) as exc:
            logger.warning("prompt cache: cannot copy the KV: %s", exc)
            return
        name = _name(states.fingerprint, prompt)
        writer = threading.Thread(
            target=self._write, args=(states, name, capture), name="edgeinfer-prompt-cache"
        )  # not a daemon: an exiting process finishes its snapshot (atomic either way)
        with self._lock:
            self._writer = writer
        writer.start()

    def _write(self, states: SeqStates, name: str, capture: Capture) -> None:
        path = self.folder / name
        try:
            size = states.write(path, capture)
        except SnapshotError as exc:
            with self._lock:
                self._counts["write_failures"] += 1
            logger.warning("prompt cache: %s", exc)
            return
        entry = _Entry(path, capture.tokens, capture.reusable, size, states.fingerprint)
        with self._lock:
            self._counts["writes"] += 1
            self._entries[name] = entry
            self._drop_covered(entry)
        self.evict()

    def _drop_covered(self, new: _Entry) -> None:
        """Remove this model's snapshots whose tokens the new one starts with (a
        conversation grows): the new one serves every prompt they served."""
        for other in list(self._entries.values()):
            if other.path == new.path or other.fingerprint != new.fingerprint or not other.own:
                continue
            if new.tokens[: len(other.tokens)] == other.tokens and new.reusable >= other.reusable:
                _unlink(other.path)
                del self._entries[other.path.name]

    def evict(self) -> None:
        """Delete the least recently used snapshots this cache wrote (and its stale temporary
        files) until they fit ``max_bytes``; leave everything else alone."""
        files, foreign = self._own_files()
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            _unlink(path)
            total -= size
            with self._lock:
                self._counts["evicted"] += 1
                self._proved.pop(path.name, None)
        with self._lock:
            self._counts["foreign_files"] = len(foreign)
            self._foreign = sorted(foreign)[:_NAMES_SHOWN]

    def _own_files(self) -> tuple[list[tuple[int, int, Path]], list[str]]:
        """(mtime_ns, size, path) of each snapshot this cache can prove it wrote, and the
        names of the other files in the folder; stale temporary files of its own removed."""
        files, foreign = [], []
        now = time.time()
        try:
            listing = list(os.scandir(self.folder))
        except OSError as exc:
            logger.warning("prompt cache: cannot list %s: %s", self.folder, exc)
            return [], []
        for item in listing:
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            regular = item.is_file(follow_symlinks=False)
            if regular and _OWN_TMP.fullmatch(item.name):
                if now - st.st_mtime > _STALE_TMP_S:
                    _unlink(Path(item.path))  # left by a process killed while writing
            elif regular and self._proves_own(Path(item.path), _stamp(st)):
                files.append((st.st_mtime_ns, st.st_size, Path(item.path)))
            else:
                foreign.append(item.name)
        return files, foreign

    def _proves_own(self, path: Path, stamp: tuple[int, ...]) -> bool:
        """Whether ``path`` is a snapshot a prompt cache wrote: a valid header whose
        fingerprint and tokens hash to the file's name (proved once per file version)."""
        if not _OWN_NAME.fullmatch(path.name):
            return False
        with self._lock:
            if self._proved.get(path.name) == stamp:
                return True
        try:
            fd = open_snapshot(path)
            try:
                header = read_header(fd, path)
            finally:
                os.close(fd)
        except SnapshotError:
            return False
        if path.name != _name(header.fingerprint, list(header.tokens)):
            return False
        with self._lock:
            self._proved[path.name] = stamp
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait for a snapshot being written."""
        writer = self._writer
        if writer is not None:
            writer.join(timeout)


def _aligned(common: int, prompt_len: int) -> int:
    """What the reuse rule lets a prompt of ``prompt_len`` reuse of a ``common`` prefix."""
    n = min(common, prompt_len - MIN_REREAD)
    return max(0, n - n % REUSE_GRANULE)


def _name(fingerprint: dict[str, Any], tokens: list[int]) -> str:
    """A snapshot's file name: the hash of its fingerprint and tokens (as JSON reads them
    back, so the name can be checked against the header)."""
    h = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0" + ",".join(map(str, tokens)).encode())
    return h.hexdigest()[:40] + SUFFIX


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is rewritten, replaced or touched."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
