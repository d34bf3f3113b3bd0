"""The suite's check that every test ends the processes it starts (a pytest plugin).

Before each test and after its call and its teardown the plugin lists the pytest process's
descendants. One that appeared during the test and still runs once the teardown is over
fails that test's teardown, by name, and is killed, so the rest of the run starts clean.
A child started by a fixture wider than one test (a module's server, a session's Ray) and
everything under it belong to that fixture until its teardown, which must have ended them.
At the end of the session nothing may be left running but Python's own helpers, which live
as long as the interpreter (multiprocessing's resource tracker and forkserver).

``end_process`` is how a test ends a child whatever happened: see the ``kill_at_end`` fixture
in tests/conftest.py.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import suppress
from typing import Any, Protocol, TypeVar

import psutil
import pytest

__all__ = ["ChildCheck", "KillAtEnd", "end_process", "register"]

GRACE_S = 5.0  # how long a child already told to stop gets before it counts as left running
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_ADVICE = "end every process a test starts whatever happens (try/finally, or kill_at_end)"

Key = tuple[int, float]  # pid and start time: a pid the system gave again is another process
_Proc = TypeVar("_Proc", bound="subprocess.Popen[Any]")


class KillAtEnd(Protocol):
    """The ``kill_at_end`` fixture's type: ``kill_at_end(subprocess.Popen(...))``."""

    def __call__(self, proc: _Proc, /) -> _Proc: ...


def _descendants() -> dict[Key, psutil.Process]:
    found: dict[Key, psutil.Process] = {}
    for proc in psutil.Process().children(recursive=True):
        with suppress(psutil.Error):
            found[(proc.pid, proc.create_time())] = proc
    return found


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _helper(proc: psutil.Process) -> bool:
    try:
        command = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(name in command for name in _HELPERS)


def _describe(proc: psutil.Process) -> str:
    try:
        command = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        command = "?"
    return f"pid {proc.pid} ({command[:160]})"


def _kill_all(procs: list[psutil.Process]) -> None:
    """Kill ``procs`` and everything under them, and wait for them to go."""
    tree = list(procs)
    for proc in procs:
        with suppress(psutil.Error):
            tree += proc.children(recursive=True)
    for proc in tree:
        with suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(tree, timeout=GRACE_S)


def end_process(proc: subprocess.Popen[Any], terminate_within: float = 0.0) -> None:
    """``proc`` and every process under it ended, whatever state they are in, ``proc`` reaped
    and its pipes closed. With ``terminate_within``, SIGTERM first and that many seconds to
    exit (a server that removes its files on the way out); then SIGKILL."""
    tree: list[psutil.Process] = []
    if proc.poll() is None:
        with suppress(psutil.Error):
            parent = psutil.Process(proc.pid)
            tree = [parent, *parent.children(recursive=True)]
    if terminate_within > 0 and proc.poll() is None:
        with suppress(OSError):
            proc.terminate()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=terminate_within)
    for child in tree:
        with suppress(psutil.Error):
            child.kill()
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=GRACE_S)
    psutil.wait_procs(tree[1:], timeout=GRACE_S)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with suppress(OSError):
                pipe.close()


class ChildCheck:
    """The plugin: which test or fixture started each child, and whether it ended it."""

    def __init__(self) -> None:
        self.owner: dict[Key, str] = {}  # a wider fixture's children: "fixture 'x' (module)"
        self.held: dict[int, tuple[str, dict[Key, psutil.Process]]] = {}  # by id(fixturedef)
        self.released: list[tuple[Key, tuple[str, psutil.Process]]] = []  # torn down: check
        self.origin: dict[Key, str] = {}  # every child seen: the test or fixture it came in
        self.before: set[Key] = set()
        self.seen: dict[Key, psutil.Process] = {}

    def _look(self, where: str) -> None:
        for key, proc in _descendants().items():
            self.seen.setdefault(key, proc)
            self.origin.setdefault(key, where)

    def _owned(self, proc: psutil.Process) -> bool:
        """Whether ``proc`` or one of its ancestors belongs to a fixture still set up."""
        try:
            return any((p.pid, p.create_time()) in self.owner for p in [proc, *proc.parents()])
        except psutil.Error:
            return False

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Any:
        self.before = set(_descendants())
        self.seen = {}
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        try:
            return (yield)
        finally:
            self._look(item.nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        try:
            result = yield
        except BaseException:
            self._look(item.nodeid)
            message = self._settle(item.nodeid)
            if message:  # the teardown failed already: the leak goes beside its error
                item.add_report_section("teardown", "processes left running", message)
            raise
        self._look(item.nodeid)
        message = self._settle(item.nodeid)
        if message:
            pytest.fail(message, pytrace=False)
        return result

    def _settle(self, nodeid: str) -> str:
        """What this test and the fixtures torn down with it left running (killed now)."""
        blame: dict[Key, tuple[str, psutil.Process]] = dict(self.released)
        self.released = []
        for key, proc in self.seen.items():
            if key not in self.before and key not in blame and not self._owned(proc):
                blame[key] = (nodeid, proc)
        running = [(who, p) for who, p in blame.values() if _running(p) and not _helper(p)]
        if not running:
            return ""
        _, alive = psutil.wait_procs([proc for _, proc in running], timeout=GRACE_S)
        running = [(who, proc) for who, proc in running if proc in alive and _running(proc)]
        lines = [f"{who} left {_describe(proc)} running (killed now)" for who, proc in running]
        _kill_all([proc for _, proc in running])
        return "\n".join([*lines, _ADVICE]) if lines else ""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: pytest.FixtureRequest) -> Any:
        if fixturedef.scope == "function":
            return (yield)
        before = set(_descendants())
        try:
            return (yield)
        finally:
            name = f"fixture {fixturedef.argname!r} ({fixturedef.scope} scope)"
            new = {
                key: proc
                for key, proc in _descendants().items()
                if key not in before and key not in self.owner  # not a nested fixture's
            }
            for key in new:
                self.owner[key] = name
                self.origin.setdefault(key, name)
            self.held.setdefault(id(fixturedef), (name, {}))[1].update(new)

    def pytest_fixture_post_finalizer(self, fixturedef: Any, request: Any) -> None:
        name, procs = self.held.pop(id(fixturedef), ("", {}))
        for key, proc in procs.items():
            self.owner.pop(key, None)
            self.released.append((key, (f"{name}, after its teardown,", proc)))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        left = [p for p in _descendants().values() if _running(p) and not _helper(p)]
        if not left:
            return
        _, alive = psutil.wait_procs(left, timeout=GRACE_S)
        alive = [p for p in alive if _running(p)]
        if not alive:
            return
        lines = [
            f"{_describe(p)}, started in {self.origin.get((p.pid, p.create_time()), '?')}"
            for p in alive
        ]
        _kill_all(alive)
        _report(session, ["processes left running at the end of the run (killed now):", *lines])
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _report(session: pytest.Session, lines: list[str]) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print("\n".join(lines), file=sys.stderr)
        return
    reporter.write_sep("=", "processes left running", red=True)
    for line in lines:
        reporter.write_line(line, red=True)


def register(config: pytest.Config) -> None:
    """Turn the check on for this run (once)."""
    if not config.pluginmanager.has_plugin("edgeinfer-child-check"):
        config.pluginmanager.register(ChildCheck(), "edgeinfer-child-check")


def pytest_configure(config: pytest.Config) -> None:
    """As ``-p tests.leakcheck``: the check alone, without the suite's conftest."""
    register(config)
