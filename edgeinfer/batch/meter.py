"""A batch job's progress line: rows done, rows/s, tokens/s and the time left, drawn on
stderr only when it is a terminal (a log file gets the summary line alone)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Meter"]

_REDRAW_S = 0.2


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
        self.tokens = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._drawn = 0.0

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._start

    def add(self, rows: int, tokens: int, errors: int) -> None:
        self.rows += rows
        self.tokens += tokens
        self.errors += errors
        now = time.monotonic()
        if self._enabled and now - self._drawn >= _REDRAW_S:
            self._drawn = now
            self._stream.write("\r" + self.line() + "\x1b[K")
            self._stream.flush()

    def line(self) -> str:
        elapsed = max(self.seconds, 1e-9)
        rate = self.rows / elapsed
        left = max(self.total - self.rows, 0)
        eta = _duration(left / rate) if rate > 0 and self.total else "?"
        total = f"/{self.total}" if self.total else ""
        errors = f" ({self.errors} errors)" if self.errors else ""
        return (
            f"batch {self.rows}{total} rows{errors}  {rate:.1f} rows/s  "
            f"{self.tokens / elapsed:.0f} tok/s  ETA {eta}"
        )

    def close(self) -> None:
        if self._enabled:
            self._stream.write("\r" + self.line() + "\x1b[K\n")
            self._stream.flush()
