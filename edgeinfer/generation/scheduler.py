"""The engine loop: one thread owns a slot backend and steps every running sequence together.

Callers (threads, the server, a batch job) submit requests; each step the loop

1. admits waiting requests, first come first served, into free slots (the free slot whose
   cache holds a reusable prefix of the prompt, so prefix reuse stays per slot and exact by
   ``KVHistory``'s rule; else the lowest free slot, keeping busy slots neighbours);
2. ends sequences whose caller cancelled or went away;
3. runs one forward pass (``decode_many``) carrying the next token of every decoding slot;
4. reads a chunk of one prefilling slot's prompt: the whole rest when nothing decodes, else a
   chunk of at most ``max_step_tokens`` minus the decoding slots, cut at absolute positions
   that are multiples of ``REUSE_GRANULE`` (so every prompt token keeps its place within
   the row groups of a whole read, and running streams keep decoding while a long prompt
   joins; a chunk's rows share the step with the decoding slots' rows, so on kernels that
   change with a step's row count, such as llama.cpp's for K-quant weights, a reply at
   ``parallel`` above 1 can depend on its neighbours: docs/many-requests.md);

and hands each slot's logits to its own ``SequenceState`` (sampler, grammar matcher, stop
strings, detokenizer), whose chunks go to that request's queue. Cancelling one sequence
leaves the others running. Work that must not meet a pass (a snapshot of a slot) runs
between two steps (``Engine.call``).

This is the only generation loop. At ``parallel=1`` the model has one slot and no engine
thread: the caller's thread steps the same loop (``Engine.run``) in its turn on the model.
Speculative decoding (``edgeinfer.generation.speculative``): a slot that decodes alone drafts tokens
and reads its pending token and the drafts in one pass (``forward``); its sequence state
steps over those rows while the sampler picks each draft itself, and the rejected entries
are rewound. While other slots decode or wait, a slot steps aside from drafting and joins
the batched step: one pass per step carries every stream.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..errors import EdgeInferError, InvalidRequestError, ModelBusyError
from .delivery import Submitted, Task, consume, delivered, merged_cancelled, never_started
from .results import REUSE_GRANULE, Chunk, KVHistory, SequenceState
from .slot_views import as_slots
from .slots import Slot, SlotView, rewind_quietly, slide, slot_for, submitted
from .speculative import draft, drop_unkept, feed

if TYPE_CHECKING:
    from ..runtimes.base import Backend, SlotBackend

__all__ = ["Engine"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PREFILL_CHUNK = 64  # prompt tokens read per step while other sequences decode


class Engine:
    """The loop that steps every sequence of one slot backend; see the module docstring."""

    def __init__(
        self,
        backend: SlotBackend | Backend,
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        max_step_tokens: int | None = None,
        disk: Any = None,
        owner: object = None,
        threaded: bool = True,
        history: KVHistory | None = None,
    ) -> None:
        slotted = as_slots(backend)
        self._backend = slotted
        # a prompt cache (edgeinfer.generation.state.attached): prefixes from disk
        self._disk = disk
        self._slots = [Slot(SlotView(slotted, s)) for s in range(slotted.n_slots)]
        if history is not None:  # slot 0's KV history is its owner's (save_state, score)
            self._slots[0].history = history
        self._chunk = max(REUSE_GRANULE, prefill_chunk - prefill_chunk % REUSE_GRANULE)
        self._max_step = max_step_tokens or slotted.n_slots + self._chunk
        self._waiting: deque[Submitted] = deque()
        self._tasks: deque[Task] = deque()  # work for the loop's thread between steps
        self._last: Slot | None = None  # the slot whose request ended last
        self._cond = threading.Condition()
        self._stopping = False
        self.threaded = threaded
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="edgeinfer-engine", daemon=True)
            self._thread.start()
        if owner is not None and threaded:  # an owner dropped without close() stops the loop
            # (and lets go of the backend) when it is collected; at exit the daemon just ends
            weakref.finalize(owner, self.close).atexit = False

    # -- callers' side ------------------------------------------------------------------

    def submit(self, request: Submitted, *, wait: bool = True) -> Iterator[Chunk]:
        """Queue one request (checked by ``check_request``) now; its chunks, in order.
        Closing the iterator early cancels the sequence."""
        request.t_submit = time.perf_counter()  # its place in the queue: from now
        with self._cond:
            if self._stopping:
                raise EdgeInferError("the model is closed; load it again")
            if not wait and (self._waiting or self._free_slots() == 0):
                raise ModelBusyError(
                    f"all {len(self._slots)} slots of the model are busy; wait for one "
                    "(wait=True, the default) or load the model with a larger parallel"
                )
            self._waiting.append(request)
            self._cond.notify_all()
        return consume(request)

    def run(self, request: Submitted) -> Iterator[Chunk]:
        """Serve one request in the caller's thread, stepping the loop between its chunks: an
        engine made with ``threaded=False`` (one slot; the caller holds the model's turn, so
        nothing else steps it meanwhile). A chunk is handed out between steps, so a consumer
        that holds it holds no engine work; one that cancels meanwhile gets its last chunk
        ("cancelled") without the engine being touched again."""
        request.t_submit = time.perf_counter()
        cancel = request.cancel
        if cancel.is_set():  # cancelled before it began (the model is being closed)
            yield never_started(self._backend, request)
            return
        slot = self._slots[0]
        with self._cond:
            if self._stopping:
                raise EdgeInferError("the model is closed; load it again")
            assert slot.request is None, "a one-slot engine serves one request at a time"
            slot.request = request
        try:
            self._start(slot)
            while True:
                while not request.out.empty():
                    item = delivered(request.out.get())
                    if item.finish_reason is None and cancel.is_set():
                        # while the consumer held the last chunk (or the model was closed):
                        # what is made already ends the stream, "cancelled"
                        if slot.request is request:
                            self._finish_cancelled(slot)
                        item = merged_cancelled(item, request.out)
                    yield item
                    if item.finish_reason is not None:
                        return
                if slot.request is not request:  # ended with nothing more to hand out
                    return
                try:
                    self._step()
                except BaseException as exc:  # the engine failed, or a signal came, mid-step
                    self._keep_valid(slot)
                    if slot.request is not request:  # it had ended: nobody else will see it
                        raise
                    self._end(slot, exc)
        finally:
            if slot.request is request:  # the consumer left early: the slot is free again
                with self._cond:
                    slot.free()

    def call(self, work: Callable[[], T]) -> T:
        """``work()`` run by the loop between two steps (at once, in this thread, for an
        engine without one: its caller holds the model's turn); its result or its error."""
        if not self.threaded:
            return work()
        task = Task(work)
        with self._cond:
            if self._stopping:
                raise EdgeInferError("the model is closed; load it again")
            self._tasks.append(task)
            self._cond.notify_all()
        return task.result()

    def on_slot(self, work: Callable[[int, KVHistory], T], what: str, *, free: bool) -> T:
        """``work(slot, history)`` between steps, on the slot whose request ended last (the
        model's current sequence at parallel > 1) or, with ``free``, on the lowest free slot,
        which then becomes it (a later prompt that starts with its tokens reuses them)."""

        def task() -> T:
            if free:
                self._last = next((s for s in self._slots if s.request is None), None)
            elif self._last is None or not self._last.history.tokens:
                raise InvalidRequestError(f"{what}: the model holds no sequence; generate first")
            slot = self._last
            if slot is None or slot.request is not None:
                raise ModelBusyError(f"{what}: the slot it needs serves a request now; try "
                                     "again once a request ends")  # fmt: skip
            return work(slot.view.slot, slot.history)

        return self.call(task)

    @property
    def activity(self) -> dict[str, int]:
        with self._cond:
            busy = len(self._slots) - self._free_slots()
            return {"slots": len(self._slots), "busy": busy, "queued": len(self._waiting)}

    def close(self) -> None:
        """End every sequence (running ones with ``cancelled``; waiting ones with an error)
        and stop the loop; the backend stays open for the caller to close."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _free_slots(self) -> int:
        return sum(1 for slot in self._slots if slot.request is None)

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._stopping
                    and not self._waiting
                    and not self._tasks
                    and self._free_slots() == len(self._slots)
                ):
                    self._cond.wait()
                if self._stopping:
                    break
                tasks, self._tasks = list(self._tasks), deque()
            for task in tasks:  # between steps: no slot's cache is in the middle of a pass
                task.run()
            with self._cond:
                admitted = self._admit()
            for slot in admitted:
                self._start(slot)
            try:
                self._step()
            except BaseException as exc:  # an engine failure ends every running sequence
                logger.exception("engine step failed")
                self._fail_running(exc)
        self._shutdown()

    def _admit(self) -> list[Slot]:
        """Move waiting requests into free slots (the caller holds the condition)."""
        admitted = []
        while self._waiting:
            free = [slot for slot in self._slots if slot.request is None]
            if not free:
                break
            request = self._waiting.popleft()
            slot = slot_for(free, request.ids)
            slot.request = request
            admitted.append(slot)
        return admitted

    def _start(self, slot: Slot) -> None:
        """Set up a just-admitted slot: its sequence state and the prompt left to read."""
        request = slot.request
        assert request is not None
        seq = SequenceState(self._backend.tokenizer, request.ids, request.sampler)
        seq.t_start = request.t_submit
        slot.seq = seq
        try:
            if self._disk is not None:
                seq.disk = self._disk.restore(slot.view, slot.history, request.ids, slot.view.slot)
            seq.reused = slot.history.reuse(slot.view, request.ids)
        except BaseException as exc:
            self._end(slot, exc)
            return
        slot.done = seq.reused
        slot.pending = request.ids[seq.reused :]

    def _step(self) -> None:
        for slot in self._slots:
            if slot.request is not None and slot.request.cancel.is_set():
                self._finish_cancelled(slot)
            elif slot.remember is not None:
                self._remember(slot)
        decoding = [slot for slot in self._slots if slot.token is not None]
        for slot in [s for s in decoding if self._must_slide(s)]:
            decoding.remove(slot)
            self._slide(slot)
        if decoding:
            self._decode(decoding)
        self._prefill_some()

    def _prefill_some(self) -> None:
        """Read prompts within the step's token budget: when no sequence decodes, every
        prompt whole, taking in requests that arrive meanwhile (a burst then decodes together
        from its first step); else chunks of them, oldest first, beside the decoding ones."""
        decoding = sum(1 for slot in self._slots if slot.token is not None)
        budget = None if decoding == 0 else max(REUSE_GRANULE, self._max_step - decoding)
        while True:
            prefilling = [slot for slot in self._slots if slot.pending]
            if not prefilling and budget is None:
                with self._cond:
                    admitted = self._admit()
                for slot in admitted:
                    self._start(slot)
                prefilling = [slot for slot in self._slots if slot.pending]
            if not prefilling or (budget is not None and budget < REUSE_GRANULE):
                return
            slot = min(prefilling, key=submitted)
            budget = self._prefill(slot, budget)

    def _decode(self, decoding: list[Slot]) -> None:
        assert all(slot.token is not None for slot in decoding)
        if len(decoding) == 1 and self._drafts_alone(decoding[0]):
            self._verify(decoding[0])
            return
        steps = [(slot.view.slot, int(slot.token)) for slot in decoding]  # type: ignore[arg-type]
        if len(steps) == 1:
            rows = self._backend.decode(steps[0][1], steps[0][0])[None, :]
        else:
            rows = self._backend.decode_many(steps)
        for i, slot in enumerate(decoding):
            slot.history.tokens.append(steps[i][1])
            self._advance(slot, rows[i])

    def _drafts_alone(self, slot: Slot) -> bool:
        """Whether ``slot`` speculates this step: it asked to, and it is the only sequence
        running or waiting (a draft's longer pass would slow every other stream's step)."""
        request = slot.request
        if request is None or request.speculation is None or self._waiting:
            return False
        return all(other is slot or other.request is None for other in self._slots)

    def _verify(self, slot: Slot) -> None:
        """One step of a slot that speculates: read its pending token and the tokens drafted
        after it in one pass, keep the drafts its sampler picks itself (each row's token, up
        to the first that differs from the draft, which is the target's own), rewind the
        rest."""
        seq, request = slot.seq, slot.request
        assert seq is not None and request is not None and slot.token is not None
        history, spec = slot.history, request.speculation
        room = self._backend.n_ctx - len(history.tokens) - 2  # a draft never fills the context
        left = min(request.sampler.config.max_new_tokens - len(seq.generated), room)
        drafts = draft(spec, seq.context, room, request.sampler.constraint, history.tokens, left)
        rows = feed(slot.view, slot.token, drafts, spec)  # type: ignore[arg-type]
        history.tokens.append(slot.token)
        kept, ended = 0, False
        for i, logits in enumerate(rows):
            if not self._advance(slot, logits):
                ended = True  # the reply ended at this row: its draft was never in question
                break
            if i >= len(drafts) or slot.token != drafts[i]:
                break
            history.tokens.append(drafts[i])  # kept: its entry is in the cache already
            kept += 1
            seq.drafted += 1  # counted as it is kept: a later row may end the reply
            seq.accepted += 1
        if drafts:
            assert spec is not None
            checked = kept if ended else len(drafts)  # after a mismatch the rest are rejected
            seq.drafted += checked - kept
            spec.record(checked, kept)
            drop_unkept(slot.view, history)  # type: ignore[arg-type]

    def _prefill(self, slot: Slot, budget: int | None) -> int | None:
        """Read the next chunk of ``slot``'s prompt (all of it when ``budget`` is None, else
        at most ``budget`` tokens, ending at a multiple of ``REUSE_GRANULE``); once it is all
        read, take the first token. Returns the budget left."""
        if budget is None:
            chunk = slot.pending
        else:
            end = (slot.done + budget) - (slot.done + budget) % REUSE_GRANULE
            chunk = slot.pending[: max(end - slot.done, 1)]
            budget -= len(chunk)
        try:
            logits = slot.view.prefill(chunk)
        except BaseException as exc:
            self._keep_valid(slot)
            self._end(slot, exc)
            return budget
        slot.done += len(chunk)
        slot.pending = slot.pending[len(chunk) :]
        request = slot.request
        assert request is not None and slot.seq is not None
        slot.history.tokens = request.ids[: slot.done]
        slot.history.batched = slot.done
        if not slot.pending:
            slot.seq.t_first = slot.seq.t_last = time.perf_counter()
            prefilled = len(request.ids) - slot.seq.reused
            going = self._advance(slot, logits)
            if self._disk is not None and not request.cancel.is_set():
                # the slot holds exactly the prompt until its next decode: the copy is made
                # then, once the first token is out (or now, if the reply already ended)
                if going:
                    slot.remember = prefilled
                else:
                    self._disk.remember(request.ids, prefilled, slot.view.slot)
        return budget

    def _remember(self, slot: Slot) -> None:
        """The prompt cache's copy of a slot that holds exactly its prompt (before the slot's
        first decode)."""
        request, prefilled, slot.remember = slot.request, slot.remember, None
        assert request is not None and prefilled is not None and self._disk is not None
        self._disk.remember(request.ids, prefilled, slot.view.slot)

    def _advance(self, slot: Slot, logits: np.ndarray) -> bool:
        """Hand one position's logits to the slot's sequence; deliver what it makes. Whether
        the sequence goes on (its next token pending in ``slot.token``)."""
        seq, request = slot.seq, slot.request
        assert seq is not None and request is not None
        full = len(slot.history.tokens) + 1 >= self._backend.n_ctx
        try:
            step = seq.step(
                logits,
                cancelled=request.cancel.is_set(),
                out_of_room=full and request.slide_keep is None,
            )
        except BaseException as exc:  # a grammar failure: this sequence only
            self._end(slot, exc)
            return False
        if step.finish is not None:
            self._end(slot, seq.last_chunk(step.text, step.finish))
            return False
        if step.text:
            request.out.put(seq.chunk(step.text))
        slot.token = step.token
        return True

    def _must_slide(self, slot: Slot) -> bool:
        request = slot.request
        full = len(slot.history.tokens) + 1 >= self._backend.n_ctx
        return full and request is not None and request.slide_keep is not None

    def _slide(self, slot: Slot) -> None:
        request = slot.request
        assert request is not None and request.slide_keep is not None and slot.token is not None
        try:
            logits = slide(slot.view, slot.history, slot.token, request.slide_keep)
        except BaseException as exc:
            self._keep_valid(slot)
            self._end(slot, exc)
            return
        self._advance(slot, logits)

    def _finish_cancelled(self, slot: Slot) -> None:
        seq = slot.seq
        assert seq is not None
        if not seq.t_first:
            seq.t_first = seq.t_last = time.perf_counter()
        self._end(slot, seq.last_chunk("", "cancelled"))

    def _end(self, slot: Slot, last: Chunk | BaseException) -> None:
        """Deliver the request's last item and free its slot."""
        request = slot.request
        assert request is not None
        request.out.put(last)
        if not isinstance(last, BaseException):
            self._last = slot
        with self._cond:
            slot.free()

    def _fail_running(self, exc: BaseException) -> None:
        """After a failed forward pass no slot's cache can be trusted: end them all."""
        for slot in self._slots:
            slot.history.clear()
            rewind_quietly(slot.view)
            if slot.request is not None:
                self._end(slot, exc)

    def _keep_valid(self, slot: Slot) -> None:
        """After a pass over this slot alone failed or was interrupted (a signal is raised
        once the engine's call has returned): entries past its history are dropped and the
        history is kept, so the next request still reuses its prefix; if even that fails,
        the slot starts over."""
        if not rewind_quietly(slot.view, len(slot.history.tokens)):
            slot.history.clear()
            rewind_quietly(slot.view)

    def _shutdown(self) -> None:
        closed = EdgeInferError("the model was closed before this request ran; load it again")
        for slot in self._slots:
            if slot.request is not None and slot.seq is not None:
                self._finish_cancelled(slot)
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            tasks, self._tasks = list(self._tasks), deque()
        for request in waiting:
            request.out.put(closed)
        for task in tasks:
            task.fail(closed)
