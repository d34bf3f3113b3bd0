"""Faults for the tests of a command's output: a small or read-only disk (a real tmpfs, where
the tests run as root on Linux), a file size limit in a child (RLIMIT_FSIZE, with SIGXFSZ
ignored so the write fails with EFBIG instead of killing it), and a child whose generated
chunks are slowed or held (a ``sitecustomize`` on its PYTHONPATH), so that a test can act
while rows are surely in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["file_size_limit", "held_env", "remount", "tmpfs"]


@contextmanager
def tmpfs(where: Path, size: int, *, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted on ``where`` (created), unmounted afterwards;
    skips the test where mounting is not possible."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs Linux and root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        if read_only:
            remount(where, "ro")
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def file_size_limit(limit: int) -> Callable[[], None]:
    """preexec_fn: files of the child may not grow past ``limit`` bytes (EFBIG past it), and
    its SIGINT is the default one (a suite run from a background job ignores it)."""

    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


_HOOK = """\
import os
import time

_SLOW = float(os.environ.get("EDGEINFER_TEST_CHUNK_S") or 0)
_GATE = os.environ.get("EDGEINFER_TEST_GATE")
_CANCEL = float(os.environ.get("EDGEINFER_TEST_CANCEL_S") or 0)
if _SLOW or _GATE or _CANCEL:
    from edgeinfer.generation import results as generation

    _next = generation.TokenStream.__next__
    _cancel = generation.TokenStream.cancel

    def _held(self):
        while _GATE and os.path.exists(_GATE):
            time.sleep(0.01)
        time.sleep(_SLOW)
        return _next(self)

    def _late(self):
        _cancel(self)
        time.sleep(_CANCEL)  # the stream ends before its canceller looks again

    generation.TokenStream.__next__ = _held
    generation.TokenStream.cancel = _late
"""


def held_env(
    folder: Path, *, chunk_s: float = 0.0, gate: Path | None = None, cancel_s: float = 0.0
) -> dict[str, str]:
    """The environment of a child ``python -m edgeinfer ...`` in which every chunk of a
    generation stream takes ``chunk_s`` seconds more and waits while ``gate`` exists, and
    a stream's ``cancel()`` returns ``cancel_s`` seconds after it asked (so the stream has
    ended when the caller goes on)."""
    hook = folder / "held-streams"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK)
    env = dict(os.environ, EDGEINFER_TEST_CHUNK_S=str(chunk_s))
    env["EDGEINFER_TEST_CANCEL_S"] = str(cancel_s)
    if gate is not None:
        env["EDGEINFER_TEST_GATE"] = str(gate)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH")) if p)
    return env
