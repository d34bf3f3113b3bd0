"""The suite's own guards, run on small test files in a separate pytest: tests/leakcheck.py
names a test or fixture that leaves a child running and kills it; pytest-timeout fails a test
that hangs and the run goes on; tests/hangcheck.py ends a run whose test SIGALRM cannot stop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

INNER = """
import os, signal, subprocess, sys, time
import pytest

PIDS = os.environ["INNER_PIDS"]

def start(*argv):
    proc = subprocess.Popen(list(argv))
    with open(PIDS, "a") as f:
        f.write(f"{proc.pid}\\n")
    return proc

def test_leaks_a_sleep():
    start("sleep", "1000")

def test_after_the_leak():
    pass

def test_ends_its_child():
    proc = start("sleep", "1001")
    try:
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()

# a shell that starts another sleep whenever a line comes in: the fixture's, not the test's
SHELL = "while read line; do sleep 1002 & done"

@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen(["sh", "-c", SHELL], stdin=subprocess.PIPE, start_new_session=True)
    yield proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

def test_asks_the_server(server):
    import psutil

    had = len(psutil.Process(server.pid).children())
    server.stdin.write(b"go\\n")
    server.stdin.flush()
    deadline = time.monotonic() + 60
    while len(psutil.Process(server.pid).children()) == had:
        assert time.monotonic() < deadline, "the shell started no sleep"
        time.sleep(0.05)

def test_asks_the_server_again(server):
    test_asks_the_server(server)

@pytest.fixture(scope="module")
def forgetful():
    yield start("sleep", "1003")

def test_uses_the_forgetful_fixture(forgetful):
    assert forgetful.poll() is None
"""

LATE = """
import os, subprocess

started = subprocess.Popen(["sleep", "1004"])  # at import: outside every test
with open(os.environ["INNER_PIDS"], "a") as f:
    f.write(f"{started.pid}\\n")

def test_nothing():
    pass
"""

HANGS = """
import time
import pytest

@pytest.mark.timeout(2)
def test_hangs():
    time.sleep(600)

def test_after_the_hang():
    pass
"""

STUCK = """
import signal, time
import pytest

@pytest.mark.timeout(1)
def test_hangs_where_sigalrm_cannot_reach():  # SIGALRM blocked: as in a stuck native call
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)

def test_never_reached():
    pass
"""


def _inner(tmp_path: Path, source: str, *options: str) -> tuple[subprocess.CompletedProcess[str],
                                                                list[int]]:  # fmt: skip
    """Run ``source`` as a test file under the suite's guards (not its conftest); the pids the
    inner tests started, each checked gone afterwards and killed if not."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(source))
    pids = tmp_path / "pids"
    pids.touch()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "INNER_PIDS": str(pids)}
    argv = [sys.executable, "-m", "pytest", "test_inner.py", "-p", "tests.leakcheck",
            "-p", "tests.hangcheck", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
            "-v", *options]  # fmt: skip
    started = []
    try:
        done = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        started = [int(line) for line in pids.read_text().split()]
        left = [p for p in map(_process, started) if p is not None]
        for proc in left:
            proc.kill()
    assert not left, f"the inner run left {left} running"
    return done, started


def _process(pid: int) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except psutil.NoSuchProcess:
        return None


def test_a_test_that_leaves_a_child_running_fails_by_name(tmp_path: Path) -> None:
    done, started = _inner(tmp_path, INNER)
    out = done.stdout
    assert done.returncode == 1, out
    assert len(started) == 3  # each sleep the tests started is gone (_inner checks)
    assert "test_inner.py::test_leaks_a_sleep left pid" in out and "sleep 1000" in out
    assert "ERROR at teardown of test_leaks_a_sleep" in out
    assert "fixture 'forgetful' (module scope), after its teardown, left pid" in out
    assert "sleep 1003" in out
    for name in ("test_after_the_leak", "test_ends_its_child", "test_asks_the_server",
                 "test_asks_the_server_again", "test_uses_the_forgetful_fixture"):  # fmt: skip
        assert f"test_inner.py::{name} PASSED" in out, out
    assert "sleep 1002" not in out and "sleep 1001" not in out  # ended, or the fixture's
    assert "1 error" not in out and "2 errors" in out  # one per leak, nothing else
    assert "processes left running at the end" not in out


def test_a_child_left_outside_every_test_fails_the_run(tmp_path: Path) -> None:
    done, started = _inner(tmp_path, LATE)
    assert len(started) == 1
    assert done.returncode == 1, done.stdout
    assert "processes left running at the end of the run (killed now):" in done.stdout
    assert f"pid {started[0]} (sleep 1004), started in " in done.stdout


def test_a_hang_fails_that_test_and_the_run_goes_on(tmp_path: Path) -> None:
    pytest.importorskip("pytest_timeout", reason="needs pytest-timeout (the test extra)")
    done, _ = _inner(tmp_path, HANGS)
    assert done.returncode == 1, done.stdout
    assert "FAILED test_inner.py::test_hangs - Failed: Timeout (>2.0s)" in done.stdout
    assert "test_inner.py::test_after_the_hang PASSED" in done.stdout


def test_a_hang_sigalrm_cannot_stop_ends_the_run_by_name(tmp_path: Path) -> None:
    pytest.importorskip("pytest_timeout", reason="needs pytest-timeout (the test extra)")
    done, _ = _inner(tmp_path, STUCK)
    assert done.returncode == 1, done.stdout
    name = "test_inner.py::test_hangs_where_sigalrm_cannot_reach"
    assert f"Timeout: {name} is still running 30 s after its 1 s timeout" in done.stderr
    assert "test_never_reached" not in done.stdout  # the run ended there
