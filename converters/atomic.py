"""Atomic output folders: build beside OUT, rename onto it only when everything succeeded.

The partial folder is ``.OUT.partial-PID`` next to OUT and carries a marker file, so the loader
refuses it and a later conversion removes it once its process is gone (after a SIGKILL, say).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgeinfer.errors import ConversionError
from edgeinfer.manifest import PARTIAL_MARKER

__all__ = ["atomic_output_dir", "atomic_output_file", "remove_stale_partials"]

logger = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(out: Path) -> None:
    """Delete partial folders of OUT left by conversions whose process no longer runs."""
    for candidate in out.parent.glob(f".{out.name}.partial-*"):
        pid_text = candidate.name.rsplit("partial-", 1)[-1].split(".", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            logger.info("removing %s, left by an interrupted conversion", candidate)
            if candidate.is_dir():
                shutil.rmtree(candidate, ignore_errors=True)
            else:
                candidate.unlink(missing_ok=True)


@contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield an empty folder to fill; it becomes OUT only if the block succeeds."""
    if out.exists() and not overwrite:
        raise ConversionError(f"{out} exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    (partial / PARTIAL_MARKER).write_text(f"{os.getpid()}\n")
    try:
        yield partial
        (partial / PARTIAL_MARKER).unlink()
        _replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


@contextmanager
def atomic_output_file(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a path beside OUT to write; it becomes OUT only if the block succeeds."""
    if out.exists() and not overwrite:
        raise ConversionError(f"{out} exists; pass --overwrite to replace it")
    if out.is_dir():
        raise ConversionError(f"{out} is a folder; name a .gguf file")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    partial.unlink(missing_ok=True)
    try:
        yield partial
        _replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


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
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
