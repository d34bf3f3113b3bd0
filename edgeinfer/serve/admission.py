"""The queue in front of the model: one running request plus at most ``max_queue`` waiting
ones, first come, first served; and ``admit``, which turns a checked request into a job in
that queue or refuses it (503: busy, or shutting down).

The queue lives here rather than in the model's own turn lock so that a waiting request can
be dropped without touching the model: a client that leaves, or a server that shuts down,
ends a waiting request at once, and a running one within one token (``TokenStream.cancel``).
"""

from __future__ import annotations

import threading
from collections import deque

from ..model import Model
from . import wire
from .jobs import Job
from .replies import busy, shutting_down

__all__ = ["Admission", "admit"]


class Admission:
    """One running request plus at most ``max_queue`` waiting ones, in arrival order."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._order: deque[Job] = deque()  # admitted jobs; the first one runs
        self.closing = False

    def enter(self, job: Job) -> bool:
        """Admit ``job``; False when the queue is full or the server is shutting down."""
        with self._cond:
            if self.closing or len(self._order) > self.max_queue:
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


def admit(
    model: Model, parsed: wire.ChatRequest | wire.CompletionRequest, admission: Admission
) -> Job:
    """The request's job, admitted into the queue; InvalidRequestError (a prompt over the
    context, a bad setting) is raised here, before the response starts."""
    if admission.closing:
        raise shutting_down()
    if isinstance(parsed, wire.ChatRequest):
        stream = model.chat(parsed.messages, stream=True, **parsed.sampling)
    else:
        stream = model.stream(parsed.prompt, **parsed.sampling)
    job = Job(stream, admission)
    if admission.enter(job):
        return job
    if admission.closing:
        raise shutting_down()
    raise busy(admission.max_queue)
