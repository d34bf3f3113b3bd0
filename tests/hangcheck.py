"""A backstop for the suite's per-test timeout (a pytest plugin beside pytest-timeout).

pytest-timeout's ``signal`` method fails the test that runs past its timeout and the run goes
on, but SIGALRM only reaches Python code: a test stuck inside a native call (an engine's
kernel, a C library's wait) or with SIGALRM blocked never sees it. This thread waits a grace
period past each test's timeout; a test still running then is named, its threads' stacks are
printed, every process under pytest is killed and the run ends with exit status 1, instead of
hanging until someone notices.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from contextlib import suppress
from typing import Any

import psutil
import pytest

__all__ = ["HangBackstop", "register"]


def _grace(limit: float) -> float:
    """How long past its timeout a test gets to unwind (its finally blocks, its teardown)."""
    return min(120.0, max(30.0, limit / 5))


class HangBackstop:
    def __init__(self, default: float | None) -> None:
        self.default = default

    def _limit(self, item: pytest.Item) -> float | None:
        marker = item.get_closest_marker("timeout")
        if marker is not None:
            value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
            if value is not None:
                return float(value)
        return self.default

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        limit = self._limit(item)
        if not limit or limit <= 0:
            return (yield)
        grace = _grace(limit)
        timer = threading.Timer(limit + grace, _abort, (item, limit, grace))
        timer.name = f"hang backstop for {item.nodeid}"
        timer.daemon = True
        timer.start()
        try:
            return (yield)
        finally:
            timer.cancel()


def _abort(item: pytest.Item, limit: float, grace: float) -> None:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    with suppress(Exception):
        if capman is not None:
            capman.suspend_global_capture(in_=True)
    sys.stderr.write(
        f"\n+++ Timeout: {item.nodeid} is still running {grace:.0f} s after its {limit:.0f} s"
        " timeout: it hangs where SIGALRM cannot stop it (inside a native call, or with"
        " SIGALRM blocked). Its threads:\n"
    )
    sys.stderr.flush()
    with suppress(Exception):
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    children = psutil.Process().children(recursive=True)
    for child in children:
        with suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=10)
    sys.stderr.write(f"+++ killed {len(children)} processes under pytest; the run ends here\n")
    sys.stderr.flush()
    os._exit(1)


def register(config: pytest.Config) -> None:
    """Turn the backstop on for this run (once), when pytest-timeout is there."""
    if config.pluginmanager.has_plugin("edgeinfer-hang-backstop"):
        return
    if not any(config.pluginmanager.has_plugin(n) for n in ("timeout", "pytest_timeout")):
        return
    import pytest_timeout

    settings = pytest_timeout.get_env_settings(config)
    if settings.func_only:  # its timer starts with the call: a setup may take longer
        return
    if config.getoption("usepdb", False) or config.getoption("trace", False):
        return  # someone at a debugger prompt is not a hang
    config.pluginmanager.register(HangBackstop(settings.timeout), "edgeinfer-hang-backstop")


def pytest_configure(config: pytest.Config) -> None:
    """As ``-p tests.hangcheck``: the backstop alone, without the suite's conftest."""
    register(config)
