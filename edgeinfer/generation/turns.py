"""Who may use a one-slot model's engine when: a first-come, first-served lock (``Turns``:
requests run one at a time, in arrival order) and the lock their steps run under
(``OpenStreams``: free between chunks, so ``close()`` never waits for a consumer).

``threading.Lock`` makes no promise about which waiter goes next, so a busy model could
starve a request. Here each request takes a ticket and runs when its number comes up; a
waiter that gives up (an exception while waiting, such as KeyboardInterrupt) hands its turn
on instead of blocking everyone behind it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..errors import ModelBusyError

if TYPE_CHECKING:
    from .results import Chunk

__all__ = ["OpenStreams", "Turns"]


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


class OpenStreams:
    """The requests of a one-slot model between their first step and their end, and the lock
    their engine work runs under. A chunk is handed out with the lock free, so ``close()``
    (``end_all``, then the lock) waits for one step at most, never for a consumer that holds
    a chunk."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entered when a collected stream ends inside a step
        self._guard = threading.Lock()  # the set below
        self._cancels: set[threading.Event] = set()
        self._ending = False

    def steps(
        self, check: Callable[[], None], cancel: threading.Event, start: Callable[[], Iterator]
    ) -> Iterator[Chunk]:
        """``start()``'s chunks, each made holding the lock, once ``check()`` passed under it."""
        with self.lock:
            check()
            chunks = start()
            with self._guard:
                self._cancels.add(cancel)
                if self._ending:  # it came while the model was being closed
                    cancel.set()
        try:
            while True:
                with self.lock:
                    chunk = next(chunks, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            with self._guard:
                self._cancels.discard(cancel)
            with self.lock:
                chunks.close()

    def end_all(self) -> None:
        """Ask every open request, and any that starts from now on, to stop: each ends
        "cancelled" at its next step, without touching the engine again."""
        with self._guard:
            self._ending = True
            for cancel in self._cancels:
                cancel.set()
