"""The queue in front of the model: up to ``slots`` running requests (the model's sequence
slots, ``model.parallel``) plus at most ``max_queue`` waiting ones, first come, first served;
and ``admit``, which turns a checked request into a job in that queue or refuses it (503:
busy, or shutting down).

The queue lives here rather than in the model's own admission so that a waiting request can
be dropped without touching the model: a client that leaves, or a server that shuts down,
ends a waiting request at once, and a running one within one token (``TokenStream.cancel``).
With one slot this is the one-at-a-time line of a single-sequence model; with N, the first N
admitted jobs run at once (the model's engine batches their tokens into one forward pass per
step) and the rest wait in arrival order for the next free slot.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from ..model import Model
from . import wire
from .jobs import Job
from .replies import busy, shutting_down

__all__ = ["Admission", "admit", "model_activity", "model_slots"]


class Admission:
    """At most ``slots`` running requests plus ``max_queue`` waiting ones, in arrival order."""

    def __init__(self, max_queue: int, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be 1 or more")
        self.max_queue = max_queue
        self.slots = slots
        self._cond = threading.Condition()
        self._order: deque[Job] = deque()  # admitted jobs; the first ``slots`` of them run
        self.closing = False

    def enter(self, job: Job) -> bool:
        """Admit ``job``; False when the queue is full or the server is shutting down."""
        with self._cond:
            if self.closing or len(self._order) >= self.slots + self.max_queue:
                return False
            self._order.append(job)
            return True

    def wait_turn(self, job: Job) -> bool:
        """Block until ``job`` holds a slot (True) or has been cancelled (False)."""
        with self._cond:
            self._cond.wait_for(lambda: job.cancelled or self._holds_slot(job))
            return not job.cancelled

    def _holds_slot(self, job: Job) -> bool:
        """Among the first ``slots`` admitted jobs (the caller holds the condition)."""
        for i, other in enumerate(self._order):
            if other is job:
                return True
            if i + 1 >= self.slots:
                return False
        return False

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
        """Any request admitted, running or waiting."""
        with self._cond:
            return bool(self._order)

    @property
    def running(self) -> int:
        """Admitted requests holding a slot."""
        with self._cond:
            return min(len(self._order), self.slots)

    @property
    def waiting(self) -> int:
        """Admitted requests waiting for a slot."""
        with self._cond:
            return max(0, len(self._order) - self.slots)


def model_slots(model: Model) -> int:
    """The sequences ``model`` runs at once (``model.parallel``; 1 for a model without slots)."""
    return int(getattr(model, "parallel", 1))


def model_activity(model: Model, admission: Admission) -> dict[str, int]:
    """``{"slots", "busy", "queued"}`` as ``model.activity`` gives them, with the requests
    waiting in the server's own queue counted as queued. A model without ``activity``
    (one slot, no engine) is described by the server's queue alone."""
    activity: Any = getattr(model, "activity", None)
    waiting = admission.waiting
    if not isinstance(activity, dict):
        return {"slots": admission.slots, "busy": admission.running, "queued": waiting}
    return {
        "slots": int(activity.get("slots", admission.slots)),
        "busy": int(activity.get("busy", admission.running)),
        "queued": int(activity.get("queued", 0)) + waiting,
    }


def admit(
    model: Model, parsed: wire.ChatRequest | wire.CompletionRequest, admission: Admission
) -> Job:
    """The request's job, admitted into the queue; InvalidRequestError (a prompt over the
    context, a bad setting) is raised here, before the response starts. The model's stream
    takes a slot only when its job's thread starts iterating it, after its turn here."""
    if admission.closing:
        raise shutting_down()
    if isinstance(parsed, wire.ChatRequest):
        stream = model.chat(parsed.messages, stream=True, **parsed.tools, **parsed.sampling)
    else:
        stream = model.stream(parsed.prompt, **parsed.sampling)
    job = Job(stream, admission)
    if admission.enter(job):
        return job
    stream.close()  # never iterated: it holds nothing, but says so to the model at once
    if admission.closing:
        raise shutting_down()
    raise busy(admission.max_queue)
