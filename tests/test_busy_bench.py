"""The bench report shows how busy the machine was when the bench began (busy.py)."""

from __future__ import annotations

from typing import Any

import pytest

from edgeinfer.bench.report import BenchReport


@pytest.mark.parametrize("value", [None, "x", 5, {"line": 5}, {"line": "load average 9; BUSY"}])
def test_bench_text_shows_the_busy_line_and_ignores_junk(value: Any) -> None:
    machine: dict[str, Any] = {"cpu_model": "Test CPU", "physical_cores": 2, "arch": "x86_64"}
    if value is not None:
        machine["busy"] = value
    report = BenchReport(settings={}, machine=machine, versions={}, created="", command=[])
    text = report.text()
    shown = isinstance(value, dict) and isinstance(value["line"], str)
    assert ("cpu load at start: load average 9; BUSY" in text) == shown
