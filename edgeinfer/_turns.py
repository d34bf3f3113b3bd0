"""A first-come, first-served lock: requests to one model run one at a time, in arrival order.

``threading.Lock`` makes no promise about which waiter goes next, so a busy model could
starve a request. Here each request takes a ticket and runs when its number comes up; a
waiter that gives up (an exception while waiting, such as KeyboardInterrupt) hands its turn
on instead of blocking everyone behind it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import ModelBusyError

__all__ = ["Turns"]


class Turns:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0  # next ticket to hand out
        self._serving = 0  # ticket whose turn it is
        self._abandoned: set[int] = set()
        self._owner: int | None = None  # thread whose request is running

    @contextmanager
    def turn(self, *, wait: bool = True) -> Iterator[None]:
        """Hold the model for one request; with ``wait=False`` raise ModelBusyError if busy."""
        ticket = self._take(wait)
        try:
            yield
        finally:
            self._done(ticket)

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._issued != self._serving

    @property
    def waiting(self) -> int:
        """Requests holding or waiting for a turn."""
        with self._cond:
            return self._issued - self._serving - len(self._abandoned)

    def _take(self, wait: bool) -> int:
        with self._cond:
            if self._owner == threading.get_ident():
                raise ModelBusyError(
                    "this thread is still inside an unfinished stream of this model; finish or "
                    "close it first (stream.close(), or use 'with model.stream(...) as s:')"
                )
            if not wait and self._issued != self._serving:
                raise ModelBusyError(
                    "the model is serving another request; wait for it (wait=True, the "
                    "default) or load a second model"
                )
            ticket = self._issued
            self._issued += 1
            try:
                while ticket != self._serving:
                    self._cond.wait()
            except BaseException:
                self._abandoned.add(ticket)
                self._advance()
                raise
            self._owner = threading.get_ident()
            return ticket

    def _done(self, ticket: int) -> None:
        with self._cond:
            if ticket == self._serving:
                self._owner = None
                self._serving += 1
                self._advance()

    def _advance(self) -> None:
        """Skip abandoned tickets, then wake the waiters (the caller holds the condition)."""
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()
