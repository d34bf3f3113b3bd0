"""A request in the generation loop, and its chunks on their way to the caller: the
request as submitted (``Submitted``), the caller's side of its queue (``consume``), and the
last chunk of a request cancelled while chunks were still on their way (``merged_cancelled``)
or before it began (``never_started``)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .results import Chunk, SequenceState
from .sampling import Sampler
from .speculative import Speculation

if TYPE_CHECKING:
    from ..runtimes.base import SlotBackend

__all__ = [
    "Submitted",
    "Task",
    "consume",
    "delivered",
    "merged_cancelled",
    "never_started",
]

_POLL_S = 0.1  # how often a waiting consumer looks up from its queue (for signals)


@dataclass(eq=False)
class Submitted:
    """A request handed to the generation loop: its ids, sampler, cancel event, slide keep
    and speculation, and the queue its chunks (or its error) go to."""

    ids: list[int]
    sampler: Sampler
    cancel: threading.Event
    slide_keep: int | None
    speculation: Speculation | None = None
    out: queue.SimpleQueue[Chunk | BaseException] = field(default_factory=queue.SimpleQueue)
    t_submit: float = field(default_factory=time.perf_counter)


def consume(request: Submitted) -> Iterator[Chunk]:
    """The request's chunks as the engine delivers them; leaving early cancels it."""
    try:
        while True:
            try:
                item = request.out.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        request.cancel.set()


def delivered(item: Chunk | BaseException) -> Chunk:
    if isinstance(item, BaseException):
        raise item
    return item


def merged_cancelled(first: Chunk, out: queue.SimpleQueue[Chunk | BaseException]) -> Chunk:
    """``first`` and every chunk queued after it, up to the request's last one, as one last
    chunk ending "cancelled" (its stats are the sequence's, made when it ended)."""
    parts = [first]
    while parts[-1].finish_reason is None and not out.empty():
        parts.append(delivered(out.get()))
    return replace(
        parts[-1],
        text="".join(p.text for p in parts),
        token_ids=tuple(t for p in parts for t in p.token_ids),
        logprobs=tuple(lp for p in parts for lp in p.logprobs),
        finish_reason="cancelled",
    )


def never_started(backend: SlotBackend, request: Submitted) -> Chunk:
    """The one chunk of a request cancelled before it began."""
    seq = SequenceState(backend.tokenizer, request.ids, request.sampler)
    seq.t_start = seq.t_first = seq.t_last = time.perf_counter()
    seq.reused = len(request.ids)  # nothing was read: no prefill rate
    return seq.last_chunk("", "cancelled")


class Task:
    """Work handed to the loop's thread (``Engine.call``), and its result or error for the
    caller, who waits for it."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self._work = work
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as exc:  # the caller gets it, the loop goes on
            self._error = exc
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def result(self) -> Any:
        while not self._done.wait(_POLL_S):  # woken now and then, so signals are handled
            pass
        if self._error is not None:
            raise self._error
        return self._value
