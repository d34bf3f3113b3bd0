"""A batch job's progress line, drawn on stderr only when it is a terminal (a log file gets
the summary line alone): from the job's start, the rows done of the total, the rows running,
rows/s, tokens/s (counted as they are generated) and the time left.

While the line is drawn, a log line (a warning about a row) is printed on a line of its own
above it, never glued to it: the root logger's handlers that write to the same stream are
wrapped for the job's life, and the progress line is drawn again under it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["Meter"]

_REDRAW_S = 0.2
_CLEAR = "\r\x1b[K"  # back to the line's start, and erase it


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Meter:
    """Counts rows and completion tokens of one job; ``total`` is the rows it expects to run."""

    def __init__(self, total: int, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self.total = max(total, 0)
        self.rows = 0
        self.errors = 0
        self.tokens = 0  # completion tokens of the records written
        self.running = 0
        self._generated = 0  # tokens as they stream, cancelled rows' too (for the rate)
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._drawn = -_REDRAW_S
        self.lock = threading.RLock()  # the line and the log lines above it

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._start

    def streamed(self, tokens: int) -> None:
        """``tokens`` more generated (any thread)."""
        with self.lock:
            self._generated += tokens

    def add(self, rows: int, tokens: int, errors: int) -> None:
        self.rows += rows
        self.tokens += tokens
        self.errors += errors
        self._draw()

    def tick(self, running: Callable[[], int]) -> None:
        """Redraw now and then while rows run (``running()``: how many)."""
        if self.enabled and time.monotonic() - self._drawn >= _REDRAW_S:
            self.running = running()
            self._draw()

    def line(self) -> str:
        elapsed = max(self.seconds, 1e-9)
        rate = self.rows / elapsed
        left = max(self.total - self.rows, 0)
        eta = _duration(left / rate) if rate > 0 and self.total else "?"
        total = f"/{self.total}" if self.total else ""
        errors = f" ({self.errors} errors)" if self.errors else ""
        tokens = max(self._generated, self.tokens)
        return (
            f"batch {self.rows}{total} rows done{errors}, {self.running} running  "
            f"{rate:.1f} rows/s  {tokens / elapsed:.0f} tok/s  ETA {eta}"
        )

    def note(self, message: str) -> None:
        """``message`` on a line of its own (above the progress line, when one is drawn)."""
        with self.lock:
            self._stream.write((_CLEAR if self.enabled else "\n") + message + "\n")
            self._stream.flush()
            self._drawn = -_REDRAW_S

    @contextmanager
    def showing(self) -> Iterator[None]:
        """The line drawn from now until the job ends (then left with the final figures),
        log lines printed above it meanwhile."""
        if not self.enabled:
            yield
            return
        root = logging.getLogger()
        wrapped = [(h, _Above(h, self)) for h in root.handlers if _writes_to(h, self._stream)]
        for inner, outer in wrapped:
            root.removeHandler(inner)
            root.addHandler(outer)
        self._draw()
        try:
            yield
        finally:
            for inner, outer in wrapped:
                root.removeHandler(outer)
                root.addHandler(inner)
            self.close()

    def cleared(self) -> None:
        """The line is erased now (a log line takes its place); the next tick draws it."""
        self._stream.write(_CLEAR)
        self._drawn = -_REDRAW_S

    def _draw(self) -> None:
        now = time.monotonic()
        if self.enabled and now - self._drawn >= _REDRAW_S:
            with self.lock:
                self._drawn = now
                self._stream.write(_CLEAR + self.line())
                self._stream.flush()

    def close(self) -> None:
        if self.enabled:
            with self.lock:
                self._stream.write(_CLEAR + self.line() + "\n")
                self._stream.flush()


def _writes_to(handler: logging.Handler, stream: TextIO) -> bool:
    return getattr(handler, "stream", None) is stream


class _Above(logging.Handler):
    """A handler that prints its records above the progress line, then lets it be drawn
    again; it hands each record to the handler it wraps."""

    def __init__(self, inner: logging.Handler, meter: Meter) -> None:
        super().__init__(inner.level)
        self.inner = inner
        self._meter = meter

    def handle(self, record: logging.LogRecord) -> bool:
        with self._meter.lock:
            if self.inner.level > record.levelno or not self.inner.filter(record):
                return False
            self._meter.cleared()
            self.inner.handle(record)
            return True

    def emit(self, record: logging.LogRecord) -> None:
        self.inner.emit(record)
