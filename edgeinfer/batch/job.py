"""The batch job: rows of a file through one model, records appended in input order.

Up to two requests per sequence slot are in flight, each on a thread of a small pool calling
the model (a model loaded with ``parallel=N`` runs concurrent calls in one batch); finished
rows are written as soon as every row before them is, so the output is always a prefix of
the whole job's output and a re-run resumes where it stopped.

Ctrl-C (on the main thread) stops reading rows and finishes the ones in flight; a second
Ctrl-C cancels those and writes only the rows finished before it (a cancelled row's record is
never written: it runs on resume); then KeyboardInterrupt is raised. Either way the output
resumes. The output is locked for the job's life: a second job on it is refused.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..errors import EdgeInferError, InvalidRequestError, short_repr
from ..generation.sampling import SamplingConfig
from .files import count_lines, read_rows
from .meter import Meter
from .output import OutputFile, check_output, recover
from .records import Row, encode_record, error_record, result_record

__all__ = ["BatchSummary", "run_batch", "run_row", "run_rows"]

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often the main thread looks at Ctrl-C while it waits for a row
_QUEUE_SLACK = 1024  # finished error rows that may wait behind a running row


@dataclass(frozen=True)
class BatchSummary:
    """What one run of a job did: ``written`` records appended this run (``errors`` of them
    error records), ``skipped`` rows already in the output, completion tokens, seconds."""

    output: Path
    written: int
    errors: int
    skipped: int
    completion_tokens: int
    seconds: float


def run_row(
    model: Any,
    row: Row,
    on_stream: Callable[[Any], None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The record of one row: the model's answer, or an error record. The one function the
    local job and the Ray job share. ``on_stream`` gets the row's stream (to cancel it),
    ``on_tokens`` the number of tokens of each chunk as it comes (the progress line)."""
    if row.error is not None or row.request is None:
        error = row.error or {"type": "InvalidRequestError", "message": "no request"}
        return error_record(row.id, error["type"], error["message"])
    req = row.request
    try:
        if req.messages is not None:
            stream = model.chat(list(req.messages), req.config, stream=True)
        else:
            stream = model.stream(req.prompt, req.config)
        if on_stream is not None:
            on_stream(stream)
        for chunk in stream:
            if on_tokens is not None:
                on_tokens(len(chunk.token_ids))
        result = stream.result
    except EdgeInferError as exc:  # too long for the context, a bad grammar, no template...
        return error_record(row.id, type(exc).__name__, str(exc))
    if result.format_incomplete:
        log.warning(
            "row %s (line %d): the reply ended after %d tokens (max_tokens or the context) "
            "before its response_format was complete: its text does not match the format; "
            "raise max_tokens",
            short_repr(row.id, 40),
            row.line,
            result.stats.completion_tokens,
        )
    return result_record(row.id, result)


class RowWarnings(logging.Filter):
    """Drops the generation loop's unnamed warning that a reply stopped before its format
    was complete: during a batch job :func:`run_row` says it, naming the row."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "before its response_format was complete" not in str(record.msg)


@contextmanager
def row_warnings() -> Iterator[None]:
    """Warnings about a row name the row, for as long as the job runs."""
    generation_log = logging.getLogger("edgeinfer.generation.results")
    quiet = RowWarnings()
    generation_log.addFilter(quiet)
    try:
        yield
    finally:
        generation_log.removeFilter(quiet)


def run_rows(model: Any, rows: Sequence[Row], window: int) -> list[dict[str, Any]]:
    """The records of ``rows`` in order, ``window`` of them in flight at once."""
    with ThreadPoolExecutor(max(1, window), thread_name_prefix="edgeinfer-batch") as pool:
        return list(pool.map(lambda row: run_row(model, row), rows))


def run_batch(
    model: Any,
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    parallel: int | None = None,
    config: SamplingConfig | None = None,
    progress: bool = True,
    progress_stream: TextIO | None = None,
    **sampling: Any,
) -> BatchSummary:
    """Run every row of ``in_path`` (JSON Lines, or CSV by its suffix) through ``model`` and
    append one record per row to ``out_path``, in input order.

    ``model`` is a loaded Model, or a name/path loaded here with ``parallel`` slots (and
    closed at the end). Rows take ``config``/``sampling`` as defaults for their own fields.
    Rows whose ids are already in ``out_path`` are skipped, so running the same job again
    resumes it; ``out_path`` is locked for the job's life (another job on it: an
    InvalidRequestError), and a write that fails (a full disk) is an OutputWriteError with
    the records before it kept whole. Ctrl-C: see the module's doc; KeyboardInterrupt is
    raised once the output is left in a state that resumes.
    """
    src = Path(in_path)
    dst = check_paths(src, out_path)
    base = SamplingConfig.from_kwargs(config, **sampling)
    if isinstance(model, (str, os.PathLike)):
        from ..loader import load

        extra = {"parallel": parallel} if parallel not in (None, 1) else {}
        with load(model, **extra) as loaded:
            return run_batch(
                loaded,
                src,
                dst,
                parallel=parallel,
                config=base,
                progress=progress,
                progress_stream=progress_stream,
            )
    slots = parallel or int(getattr(model, "parallel", 1))
    with OutputFile(dst) as out:  # locked: a second job on it is refused
        plan = Plan(recover(dst))
        meter = Meter(count_lines(src) - plan.done, progress_stream, enabled=progress)
        job = _Job(model, 2 * max(1, slots), meter)
        with meter.showing(), row_warnings(), job.running(out), _interrupts(job):
            for row in plan.pending(read_rows(src, base)):
                if job.stopping:
                    break
                job.submit(row)
            job.drain()
    summary = BatchSummary(dst, job.written, job.errors, plan.skipped, meter.tokens, meter.seconds)
    if job.stopping:
        log.warning(
            "stopped: %d rows written to %s this run; run the same command again to resume",
            job.written,
            dst,
        )
        raise KeyboardInterrupt
    return summary


def check_paths(src: Path, out: str | os.PathLike[str]) -> Path:
    """The output's path, once the input is a file and the output may hold the records."""
    if not src.is_file():
        raise InvalidRequestError(f"the input {src} is not a file")
    return check_output(out, src)


class Plan:
    """Which rows run: the k-th row with an id runs unless the output already holds k records
    with that id; a row whose id came before in the input is a duplicate (an error record)."""

    def __init__(self, done: Counter[str]) -> None:
        self._done = done
        self.done = sum(done.values())  # records already in the output
        self._seen: Counter[str] = Counter()
        self._first: dict[str, int] = {}
        self.skipped = 0

    def pending(self, rows: Iterable[Row]) -> Iterator[Row]:
        for row in rows:
            key = row.key
            k = self._seen[key]
            self._seen[key] += 1
            self._first.setdefault(key, row.line)
            if k < self._done[key]:
                self.skipped += 1
            elif k > 0:
                first = self._first[key]
                message = f"id {row.id!r} is a duplicate (first at line {first}); ids are unique"
                yield Row(row.line, row.id, error={"type": "DuplicateId", "message": message})
            else:
                yield row


class _Job:
    """Rows in flight and the ordered writer."""

    def __init__(self, model: Any, window: int, meter: Meter) -> None:
        self._model = model
        self._window = window
        self.meter = meter
        self._queue: deque[tuple[Row, Future[dict[str, Any]] | dict[str, Any]]] = deque()
        self._streams: set[Any] = set()
        self._unfinished: set[Future[dict[str, Any]]] = set()  # in flight at the abandon
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._out: OutputFile | None = None
        self.stopping = False  # first Ctrl-C: read no more rows
        self.abandoned = False  # second Ctrl-C: cancel the rows in flight
        self._cut_short: Row | None = None  # a row cancelled by something else than Ctrl-C
        self.written = 0
        self.errors = 0

    @contextmanager
    def running(self, out: OutputFile) -> Iterator[None]:
        self._out = out
        with ThreadPoolExecutor(self._window, thread_name_prefix="edgeinfer-batch") as pool:
            self._pool = pool
            try:
                yield
            except BaseException:
                self.abandon()  # the job failed: the rows in flight need not finish
                raise
            finally:
                self._pool = None

    def submit(self, row: Row) -> None:
        while self._busy() >= self._window or len(self._queue) >= self._window + _QUEUE_SLACK:
            self._wait_head()
            if self.stopping:
                return  # not started: it runs on resume
        assert self._pool is not None
        if row.error is not None:
            self._queue.append((row, run_row(self._model, row)))
        else:
            args = (self._model, row, self._track, self.meter.streamed)
            self._queue.append((row, self._pool.submit(run_row, *args)))
        self._write_ready()
        self.meter.tick(self._busy)

    def drain(self) -> None:
        while self._queue and not self.abandoned:
            self._wait_head()
        self._write_ready()
        if self._cut_short is not None:
            raise EdgeInferError(
                f"row {short_repr(self._cut_short.id, 40)} (line {self._cut_short.line}) was "
                f"cancelled before it finished (was the model closed?); {self.written} records "
                "were written: run the same command again to resume"
            )

    def stop(self) -> None:
        """First Ctrl-C: read no more rows, finish those in flight."""
        self.stopping = True

    def abandon(self) -> None:
        """Second Ctrl-C: cancel the rows in flight; none of them is written (each runs
        again on resume), so the output stays a prefix of the whole job's."""
        self._unfinished.update(
            item for _, item in list(self._queue) if isinstance(item, Future) and not item.done()
        )
        self.stopping = self.abandoned = True
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()

    def _busy(self) -> int:
        return sum(1 for _, item in self._queue if isinstance(item, Future) and not item.done())

    def _track(self, stream: Any) -> None:
        with self._lock:
            self._streams.add(stream)
        if self.abandoned:
            stream.cancel()

    def _wait_head(self) -> None:
        head = self._queue[0][1] if self._queue else None
        if isinstance(head, Future):
            wait([head], timeout=_POLL_S)
        self._write_ready()
        self.meter.tick(self._busy)

    def _write_ready(self) -> None:
        """Append every finished row at the head of the queue, in one write."""
        lines: list[bytes] = []
        tokens = errors = 0
        while self._queue:
            row, item = self._queue[0]
            record = self._finished(row, item)
            if record is None:
                break
            self._queue.popleft()
            lines.append(encode_record(record))
            errors += record["error"] is not None
            tokens += (record["usage"] or {}).get("completion_tokens", 0)
        if lines and self._out is not None:
            self._out.append(lines)
            self.written += len(lines)
            self.errors += errors
            self.meter.add(len(lines), tokens, errors)

    def _finished(self, row: Row, item: Future[dict[str, Any]] | dict[str, Any]) -> Any:
        """The record to write for the head of the queue, or None: still running, or never
        finished (cancelled), which is never written, so that it runs again on resume."""
        if not isinstance(item, Future):
            return item
        if not item.done() or item in self._unfinished:
            return None
        record = item.result()
        if record["finish_reason"] != "cancelled":
            return record
        if not self.abandoned:  # cancelled by something else: the job cannot go on
            self._cut_short = row
            self.abandon()
        return None


@contextmanager
def _interrupts(job: _Job) -> Iterator[None]:
    """Ctrl-C as the job's stop, then abandon; a third Ctrl-C is Python's own again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:  # started with Ctrl-C ignored (nohup, a background job)
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if not job.stopping:
            job.stop()
            job.meter.note("edgeinfer: finishing the rows in flight (Ctrl-C again abandons them)")
        else:
            job.abandon()
            signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
