"""A batch job's output: one job at a time, appended whole lines at a time, and left whole
and resumable whatever stops the job (a crash, Ctrl-C, a full disk).

The output is locked (``fcntl.flock``, advisory) for the job's life, so a second job on the
same file is refused instead of writing its records beside the first's. It is only ever
appended, whole lines with one ``os.write`` each batch, so a killed process leaves at most
one torn last line, which :func:`recover` cuts off before a job resumes; a write that fails
(a full disk, a file size limit) is cut back to the last whole line before the error says
so. Written lines reach the kernel at once (a SIGKILL cannot lose them); ``fsync`` runs at
most once a second and at the end, for power loss.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections import Counter
from pathlib import Path

from ..bounded_json import open_regular, parse_json
from ..errors import EdgeInferError, InvalidRequestError
from .records import row_key

__all__ = [
    "OutputFile",
    "OutputWriteError",
    "check_free",
    "check_output",
    "recover",
    "write_failed",
]

log = logging.getLogger(__name__)

_SYNC_EVERY_S = 1.0
_MAX_RECORD_BYTES = 64 << 20  # a record holds one reply; a longer line is not a record
_RECORD_DEPTH = 80  # a record holds `parsed`, whose depth the structured-output bounds limit


class OutputWriteError(EdgeInferError):
    """An output file could not be opened or written (a full disk, a file size limit, a
    read-only file system); what was written before is left whole."""


def write_failed(path: Path | str, exc: OSError, kept: str) -> str:
    """The message for a failed write of ``path``: what failed, what is ``kept``, the fix."""
    fixes = {
        errno.ENOSPC: "the disk is full: free some space, or write elsewhere",
        errno.EDQUOT: "the disk quota is used up: free some space",
        errno.EFBIG: "the file reached a size limit (ulimit -f or the file system's): "
        "raise it or write elsewhere",
        errno.EROFS: "the file system is read-only: write elsewhere",
        errno.EACCES: "make it (and its folder) writable, or write elsewhere",
        errno.EPERM: "make it (and its folder) writable, or write elsewhere",
    }
    fix = fixes.get(exc.errno or 0, "check the disk, or write elsewhere")
    return f"cannot write {path}: {exc.strerror or exc}; {fix}; {kept}"


_KEPT = "the records written before are kept whole: run the same command again to resume"


def check_output(out: str | os.PathLike[str], src: Path) -> Path:
    """``out`` as a path for the job's records, refused before anything is opened when it
    names a folder, a folder that does not exist, or the input itself (also by a link)."""
    text = os.fspath(out)
    path = Path(text)
    if text.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)) or path.is_dir():
        what = "is a folder" if path.is_dir() else f"names a folder (it ends in {text[-1]})"
        raise InvalidRequestError(
            f"the output {text} {what}; give a file for the records, such as "
            f"{path / 'records.jsonl'}"
        )
    if not path.parent.is_dir():
        raise InvalidRequestError(
            f"the output's folder {path.parent} does not exist; create it or write elsewhere"
        )
    if _same_file(path, src):
        raise InvalidRequestError(f"the output {path} is the input; write the output elsewhere")
    if path.exists() and not path.is_file():
        raise _not_regular(path)
    return path


def _not_regular(path: Path) -> InvalidRequestError:
    return InvalidRequestError(
        f"the output {path} is not a regular file; the records are appended to a file (so "
        "that a stopped job resumes): give a file path"
    )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def recover(path: Path) -> Counter[str]:
    """The ids already in the output (counted: an id may appear twice, the second time as a
    duplicate's error record), after cutting off a torn last line a crash left."""
    if not path.exists():
        return Counter()
    done: Counter[str] = Counter()
    fd = open_regular(path, error=InvalidRequestError, what="the output")
    with os.fdopen(fd, "rb") as f:
        good = 0  # bytes of whole lines
        for n, raw in enumerate(iter(lambda: f.readline(_MAX_RECORD_BYTES + 1), b""), start=1):
            if len(raw) > _MAX_RECORD_BYTES:
                _record_key(b"", n, path)  # longer than any record: refused, unread
            if not raw.endswith(b"\n"):
                break
            done[_record_key(raw, n, path)] += 1
            good += len(raw)
        size = f.seek(0, os.SEEK_END)
    if size > good:
        log.warning("%s: cut off a torn last line (%d bytes) a stopped job left", path, size - good)
        try:
            with open(path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        except OSError as exc:
            raise OutputWriteError(write_failed(path, exc, "no row was run")) from exc
    return done


def _record_key(raw: bytes, n: int, path: Path) -> str:
    what = f"{path} line {n}"
    try:
        record = parse_json(raw, what=what, max_depth=_RECORD_DEPTH)
    except EdgeInferError:
        record = None
    row_id = record.get("id") if isinstance(record, dict) else None
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool) or "error" not in record:
        raise InvalidRequestError(
            f"{what} is not a record of edgeinfer batch; give another output file (the output "
            "is appended to, so that a stopped job resumes)"
        )
    return row_key(row_id)


def check_free(path: Path) -> None:
    """Refuse now an output another job holds (its lock is taken for real when the job
    starts: this only spares loading a model for a job that would be refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return  # missing, or unreadable: opening it for the job says what is wrong
    try:
        _lock(fd, path, quiet=True)
    finally:
        os.close(fd)


def _open_locked(path: Path) -> int:
    """A descriptor appending to ``path`` (created if missing), refused unless it is a
    regular file no other job holds. Non-blocking, so a FIFO cannot hang the open."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise OutputWriteError(write_failed(path, exc, "no row was run")) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_regular(path)
        _lock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock(fd: int, path: Path, *, quiet: bool = False) -> None:
    """Hold ``fd``'s advisory lock until it is closed; refuse if another job holds it."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; one job per output is then the user's to keep
        if not quiet:
            log.warning("%s: this system cannot lock it; run one job on it at a time", path)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise InvalidRequestError(
            f"another edgeinfer batch job is writing {path}; wait for it to end (or stop it) "
            "and run this command again to resume, or write elsewhere"
        ) from exc
    except OSError as exc:  # a file system without locks (some network mounts)
        if not quiet:
            log.warning("%s: cannot lock it (%s); run one job on it at a time", path, exc.strerror)


class OutputFile:
    """The output, locked for this job and opened for appending whole lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = _open_locked(path)
        self._synced = time.monotonic()

    def append(self, lines: list[bytes]) -> None:
        """Write ``lines`` (each ending in a newline) with one write; sync now and then. A
        failed write is cut back to the whole lines before it (OutputWriteError)."""
        data = memoryview(b"".join(lines))
        size = os.fstat(self._fd).st_size  # this job alone appends (the lock)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as exc:
            self._cut(size)
            raise OutputWriteError(write_failed(self.path, exc, _KEPT)) from exc
        if time.monotonic() - self._synced > _SYNC_EVERY_S:
            self.sync()

    def _cut(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError:  # left as a torn last line, which the next run cuts off
            log.debug("could not cut %s back to %d bytes", self.path, size, exc_info=True)

    def sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise OutputWriteError(write_failed(self.path, exc, _KEPT)) from exc
        self._synced = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: that error is the one to report
            self.close()
        except OutputWriteError:
            log.debug("could not sync %s", self.path, exc_info=True)
