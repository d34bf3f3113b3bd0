"""Requests in flight: the queue in front of the model, and one job per admitted request.

A request is admitted into a first-come, first-served queue (one runs, at most ``max_queue``
wait); its job is a worker thread that waits for its turn there, runs the model's token
stream and hands each chunk to the event loop. The queue lives here rather than in the
model's own turn lock so that a waiting request can be dropped without touching the model:
a client that leaves, or a server that shuts down, ends a waiting request at once, and a
running one within one token (``TokenStream.cancel``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, Literal

from ..generation import TokenStream

__all__ = ["Admission", "Job"]

Why = Literal["client", "shutdown"]


class Admission:
    """One running request plus at most ``max_queue`` waiting ones, in arrival order."""

    def __init__(self, max_queue: int) -> None:
        self._limit = max_queue + 1
        self._cond = threading.Condition()
        self._order: deque[Job] = deque()  # admitted jobs; the first one runs
        self.closing = False

    def enter(self, job: Job) -> bool:
        """Admit ``job``; False when the queue is full or the server is shutting down."""
        with self._cond:
            if self.closing or len(self._order) >= self._limit:
                return False
            self._order.append(job)
            return True

    def wait_turn(self, job: Job) -> bool:
        """Block until ``job`` is first in line (True) or has been cancelled (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._order[0] is job or job.cancelled)
            return not job.cancelled

    def leave(self, job: Job) -> None:
        with self._cond:
            if job in self._order:
                self._order.remove(job)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def shutdown(self) -> tuple[int, int]:
        """Refuse new requests and cancel every admitted one: (running, waiting) counts."""
        with self._cond:
            self.closing = True
            jobs = list(self._order)
        running = sum(job.started for job in jobs)
        for job in jobs:
            job.cancel("shutdown")
        return running, len(jobs) - running

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no admitted job is left; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._order, timeout)

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._order)

    @property
    def waiting(self) -> int:
        with self._cond:
            return max(0, len(self._order) - 1)


class Job:
    """One admitted request: its token stream, run in a worker thread once its turn comes.

    Events reach the event loop's queue as ``(kind, value)``: ``("chunk", Chunk)`` for each
    chunk (the last has a finish reason), then ``("end", GenerationResult)``; or
    ``("error", exception)``; or ``("dropped", None)`` for a job cancelled before its turn.
    """

    def __init__(self, stream: TokenStream, admission: Admission) -> None:
        self.stream = stream
        self.admission = admission
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.why: Why | None = None  # set once, by the first cancel()
        self.started = False  # it got its turn and runs the model
        self.tokens_sent = 0  # token ids handed to the event loop so far
        self.tokens_at_cancel: int | None = None
        self._loop = asyncio.get_running_loop()

    @property
    def cancelled(self) -> bool:
        return self.why is not None

    def start(self, name: str) -> None:
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def cancel(self, why: Why) -> None:
        """Stop the job (from any thread): a waiting one leaves the queue, a running one
        stops within one token. The first reason given is the one kept."""
        if self.why is None:
            self.why = why
            self.tokens_at_cancel = self.tokens_sent
        self.stream.cancel()
        self.admission.wake()

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.stream.cancel()

    def _work(self) -> None:
        try:
            if not self.admission.wait_turn(self):
                self._put(("dropped", None))
                return
            self.started = True
            for chunk in self.stream:
                self.tokens_sent += len(chunk.token_ids)
                self._put(("chunk", chunk))
            self._put(("end", self.stream.result))
        except Exception as exc:  # reported to the client by the reply
            self._put(("error", exc))
        finally:
            self.stream.close()
            self.admission.leave(self)
