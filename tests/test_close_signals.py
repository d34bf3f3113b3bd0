"""Model.close(): a SIGINT or SIGTERM arriving while the engine is being freed takes effect
after it is freed, never halfway through (a half-freed engine crashes on its next touch)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from edgeinfer.model import Model

from .fakes import FakeBackend


class SignalledInClose(FakeBackend):
    """Its teardown is hit by ``signals`` halfway through, then finishes."""

    def __init__(self, *signals: int) -> None:
        super().__init__()
        self.signals = signals
        self.finished = False

    def close(self) -> None:
        for signum in self.signals:
            os.kill(os.getpid(), signum)
        sum(range(100_000))  # bytecodes, where Python would run a handler
        self.finished = True
        super().close()


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_during_close_is_raised_after_it() -> None:
    backend = SignalledInClose(signal.SIGINT, signal.SIGINT)
    model = Model(backend, name="fake", path=Path("fake"), model_format="fake")
    with pytest.raises(KeyboardInterrupt):
        model.close()
    assert backend.finished and backend.closed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_apps_own_handler_runs_after_close_once_per_signal() -> None:
    seen: list[tuple[int, bool]] = []
    backend = SignalledInClose(signal.SIGTERM, signal.SIGINT)

    def handler(signum: int, _frame: object) -> None:
        seen.append((signum, backend.finished))

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        Model(backend, name="fake", path=Path("fake"), model_format="fake").close()
        assert sorted(seen) == sorted([(signal.SIGTERM, True), (signal.SIGINT, True)])
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        for signum, previous in old.items():
            signal.signal(signum, previous)
