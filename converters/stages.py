"""What every conversion route shares: its result, its stage lines and its report line.

The routes (``gguf/route.py``, ``onnx/native.py``, ``onnx/optimum.py``) import these from here
rather than from the dispatcher (``pipeline.py``), so no route imports the module that picks it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError
from edgeinfer.files.manifest import Manifest

__all__ = ["ConversionResult", "StageCallback", "Stages", "format_report", "require_passed"]

logger = logging.getLogger(__name__)

StageCallback = Callable[[str], None]


@dataclass(frozen=True)
class ConversionResult:
    path: Path
    manifest: Manifest | None  # ONNX folders; None for a GGUF file
    report: dict[str, Any]


class Stages:
    """Numbered stage lines ``[n/total] what (s so far)`` for the user, through ``callback``
    (the log when None)."""

    def __init__(self, callback: StageCallback | None, total: int) -> None:
        self._callback = callback or (lambda line: logger.info("%s", line))
        self._n = 0
        self._total = total
        self._start = time.perf_counter()

    def __call__(self, what: str) -> None:
        self._n += 1
        elapsed = time.perf_counter() - self._start
        self._callback(f"[{self._n}/{self._total}] {what} ({elapsed:.0f} s so far)")

    def detail(self, line: str) -> None:
        self._callback(line)

    def done(self, summary: str) -> None:
        elapsed = time.perf_counter() - self._start
        self._callback(f"done in {elapsed:.0f} s: {summary}")


def format_report(report: dict[str, Any]) -> str:
    from .validate import summary  # the measures and the verdict live beside the checks

    lines = [summary(report)]
    for row in report["per_prompt"]:
        if row["greedy_fraction"] < 1.0:
            tie = " (parted at a near-tie)" if row.get("parted_at_tie") else ""
            lines.append(
                f"  differs{tie}: {row['prompt']!r}: source {row['source_text']!r}, "
                f"result {row['result_text']!r}"
            )
    return "\n".join(lines)


def require_passed(report: dict[str, Any], out: Path) -> None:
    """ConversionError when the validation ``report`` failed (a skipped one passes): raised
    inside the atomic block, so nothing is written to ``out``."""
    if report.get("passed") is False:
        raise ConversionError(
            f"validation failed, nothing written to {out}:\n{format_report(report)}"
        )
