"""A minimal progress bar for long work, drawn on stderr only when it is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, *, unit: str = "bytes"
    ) -> None:
        self._label = label
        self._unit = unit
        self._total = max(total, 1)
        self._done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        self._last_draw = 0.0

    def advance(self, n: int) -> None:
        self._done += n
        now = time.monotonic()
        if self._enabled and (now - self._last_draw > 0.1 or self._done >= self._total):
            self._last_draw = now
            self._draw()

    def _draw(self) -> None:
        frac = min(self._done / self._total, 1.0)
        bar = "#" * int(frac * 30)
        if self._unit == "bytes":
            count = f"{self._done / 2**20:8.1f} MiB"
        else:
            count = f"{self._done}/{self._total} {self._unit}"
        self._stream.write(f"\r{self._label} [{bar:<30}] {frac:6.1%} {count}")
        self._stream.flush()

    def close(self) -> None:
        if self._enabled:
            self._draw()
            self._stream.write("\n")
            self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
