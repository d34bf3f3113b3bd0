"""``edgeinfer bench --json`` as a benchmark script runs it: one fresh process, outside the
checkout, and the runs of its one edgeinfer row."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any


def edgeinfer_runs(
    options: list[str], *, timeout: float, python: str = sys.executable
) -> list[dict[str, Any]]:
    """The measured runs of ``python -m edgeinfer bench OPTIONS --json`` (its edgeinfer row);
    exits naming the command when it fails or reports another number of edgeinfer rows."""
    command = [python, "-m", "edgeinfer", "bench", *options, "--json"]
    # run outside the checkout: `python -m` puts the working folder first on sys.path, where
    # this checkout's edgeinfer/ would shadow another installed one (a baseline's)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          cwd=tempfile.gettempdir())  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    rows = [r for r in json.loads(done.stdout)["results"] if r.get("engine") == "edgeinfer"]
    if len(rows) != 1:
        raise SystemExit(f"expected one edgeinfer row, got {len(rows)}: {done.stdout[:500]}")
    return rows[0]["runs"]
