"""Atomic outputs: build beside OUT, rename onto it only when everything succeeded.

The partial file or folder is ``.OUT.partial-PID`` next to OUT (a folder carries a marker
file, so the loader refuses it); whatever ends the block early (an error, Ctrl-C) removes it,
and a later conversion to the same OUT removes what a killed process (SIGKILL, power loss)
left. An existing OUT stays untouched until the new one replaces it.

Write failures are ConversionErrors: a full disk (or quota) is a DiskFullError saying where
and, when known, how much space was needed; other OSErrors name the path.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgeinfer.errors import ConversionError
from edgeinfer.files.manifest import PARTIAL_MARKER

__all__ = [
    "DiskFullError",
    "atomic_output_dir",
    "atomic_output_file",
    "ensure_free_space",
    "remove_stale_partials",
]

logger = logging.getLogger(__name__)

_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
# after a failed write, a file system with less than this available is taken to be full
# (engines such as torch's writer or llama.cpp report a failed write without its errno)
_NEARLY_FULL = 1 << 20  # bytes


class DiskFullError(ConversionError):
    """The file system receiving a conversion's output ran out of space or quota."""


def ensure_free_space(out: Path, needed: int) -> None:
    """DiskFullError unless the file system that will hold ``out`` has ``needed`` bytes."""
    free = _free_bytes(out.parent)
    if free is not None and free < needed:
        raise DiskFullError(
            f"not enough disk space for {out}: it needs about {_mb(needed)} and "
            f"{_mb(free)} are free in {out.parent}; free some space or write elsewhere"
        )


def remove_stale_partials(out: Path) -> None:
    """Clean up after conversions of OUT whose process no longer runs: delete their partial
    outputs, and put back an OUT that one was replacing when it died."""
    for candidate in sorted(out.parent.glob(f".{out.name}.partial-*")):
        if _owner_gone(candidate, "partial-"):
            logger.info("removing %s, left by an interrupted conversion", candidate)
            _remove(candidate)
    for old in sorted(out.parent.glob(f".{out.name}.old-*")):
        if not _owner_gone(old, "old-"):
            continue
        if out.exists() or out.is_symlink():
            _remove(old)
        else:  # killed between moving OUT aside and moving the new one in
            logger.info("restoring %s from %s", out, old)
            os.replace(old, out)


@contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield an empty folder to fill; it becomes OUT only if the block succeeds."""
    partial = _prepare(out, overwrite=overwrite)
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        (partial / PARTIAL_MARKER).write_text(f"{os.getpid()}\n")
        yield partial
        (partial / PARTIAL_MARKER).unlink()
        _replace(partial, out)
    except BaseException as exc:
        _fail(exc, out, partial)


@contextmanager
def atomic_output_file(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a path beside OUT to write; it becomes OUT only if the block succeeds."""
    if out.is_dir():
        raise ConversionError(f"{out} is a folder; name a file")
    partial = _prepare(out, overwrite=overwrite)
    try:
        _remove(partial)
        yield partial
        _replace(partial, out)
    except BaseException as exc:
        _fail(exc, out, partial)


def _prepare(out: Path, *, overwrite: bool) -> Path:
    if out.exists() and not overwrite:
        raise ConversionError(f"{out} exists; pass --overwrite to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out)
    except OSError as exc:
        raise ConversionError(f"cannot prepare {out.parent} for {out.name}: {exc}") from exc
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _fail(exc: BaseException, out: Path, partial: Path) -> None:
    """Remove ``partial`` and re-raise ``exc``, write failures mapped to ConversionError."""
    mapped = _mapped(exc, out, partial) if isinstance(exc, Exception) else None
    _remove(partial)
    if mapped is None:
        raise exc
    raise mapped from exc


def _mapped(exc: Exception, out: Path, partial: Path) -> ConversionError | None:
    """The error to raise instead of ``exc``, or None to keep it. Measured while the partial
    output still fills the disk."""
    if isinstance(exc, DiskFullError):
        return None
    free = _free_bytes(out.parent)
    if _is_disk_full(exc) or (free is not None and free < _NEARLY_FULL):
        return DiskFullError(
            f"the disk holding {out.parent} is full ({_mb(free or 0)} free after writing "
            f"{_mb(_size(partial))} of {out.name}); nothing was written to {out}: free some "
            f"space or write elsewhere ({exc})"
        )
    if isinstance(exc, OSError):
        return ConversionError(f"writing {out} failed, nothing was written: {exc}")
    return None


def _is_disk_full(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 16:  # the whole chain: engines wrap their OSErrors
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _replace(partial: Path, out: Path) -> None:
    """Move ``partial`` onto ``out``; an existing OUT is kept until the new one is in place."""
    if not out.exists() or (out.is_file() and partial.is_file()):
        os.replace(partial, out)  # a file is replaced in one step
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.replace(out, old)
    try:
        os.replace(partial, out)
    except BaseException:
        os.replace(old, out)
        raise
    _remove(old)


def _owner_gone(candidate: Path, tag: str) -> bool:
    pid_text = candidate.name.rsplit(tag, 1)[-1].split(".", 1)[0]
    return pid_text.isdigit() and not _pid_alive(int(pid_text))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"
