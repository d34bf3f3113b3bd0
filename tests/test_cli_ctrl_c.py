"""Ctrl-C in a command ends it with exit status 130 even where native code turned the
KeyboardInterrupt into another exception (numpy's ``tofile`` raises a TypeError when the
signal lands inside it)."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

from edgeinfer.cli.common import EXIT_INTERRUPTED, run_command
from edgeinfer.errors import ConversionError

ARGS = argparse.Namespace(debug=False)


def _interrupted_into(exc_type: type[Exception]) -> object:
    def command(_args: argparse.Namespace) -> int:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(100_000))  # bytecodes, where Python runs the handler
        except KeyboardInterrupt:
            raise exc_type("expected str, bytes or os.PathLike object") from None
        return 0

    return command


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("exc_type", [TypeError, OSError, ConversionError])
def test_ctrl_c_turned_into_another_exception_is_still_ctrl_c(
    exc_type: type[Exception], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_command(_interrupted_into(exc_type), ARGS) == EXIT_INTERRUPTED  # type: ignore[arg-type]
    assert "error" not in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("ctrl_c_raises")
def test_an_error_without_ctrl_c_is_still_an_error() -> None:
    def command(_args: argparse.Namespace) -> int:
        raise TypeError("a bug")

    with pytest.raises(TypeError):
        run_command(command, ARGS)
    assert run_command(lambda _a: (_ for _ in ()).throw(ConversionError("bad")), ARGS) == 1


def test_where_sigint_is_ignored_it_stays_ignored() -> None:
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen = []
        run_command(lambda _a: seen.append(signal.getsignal(signal.SIGINT)) or 0, ARGS)
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_a_bug_long_after_a_handled_ctrl_c_is_still_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("edgeinfer.cli.common.time.monotonic", lambda: clock[0])

    def command(_args: argparse.Namespace) -> int:
        try:  # chat stops a reply on Ctrl-C and goes on
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(100_000))
        except KeyboardInterrupt:
            pass
        clock[0] += 60
        raise TypeError("a bug a minute later")

    with pytest.raises(TypeError, match="a minute later"):
        run_command(command, ARGS)
