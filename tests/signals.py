"""Children that take Ctrl-C: a suite started from a background job inherits SIGINT ignored,
and so would every child it starts; a test that sends SIGINT restores the default first."""

from __future__ import annotations

import signal

__all__ = ["sigint_default"]


def sigint_default() -> None:
    """``preexec_fn``: SIGINT back to its default in the child, so Python there installs its
    KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
