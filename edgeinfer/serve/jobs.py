"""One job per admitted request: a worker thread that waits for its turn in the queue
(``admission.py``), runs the model's token stream and hands each chunk to the event loop.
With several slots, several jobs' threads iterate their own streams at once and the model's
engine batches them; each job still sees only its own chunks. Cancelling a job (the client
left, the server shuts down) drops a waiting one at once and stops a running one within one
token (``TokenStream.cancel``), leaving the other running jobs as they are.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Literal, Protocol

from ..generation.results import TokenStream

__all__ = ["Job", "Turns"]

Why = Literal["client", "shutdown"]


class Turns(Protocol):
    """The queue a job waits in (``admission.Admission``)."""

    def wait_turn(self, job: Job) -> bool: ...
    def leave(self, job: Job) -> None: ...
    def wake(self) -> None: ...


class Job:
    """One admitted request: its token stream, run in a worker thread once its turn comes.

    Events reach the event loop's queue as ``(kind, value)``: ``("chunk", Chunk)`` for each
    chunk (the last has a finish reason), then ``("end", GenerationResult)``; or
    ``("error", exception)``; or ``("dropped", None)`` for a job cancelled before its turn.
    """

    def __init__(self, stream: TokenStream, admission: Turns) -> None:
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
