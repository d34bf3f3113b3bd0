"""The conditions a benchmark ran under, recorded the same way in every results file that
uses it: the command, the machine (CPU model and SIMD flags), versions, threads, rounds and
the load average before and after. A figure taken above ``QUIET_LOAD`` is labelled loaded
and declares no target met (shared/BENCHMARKS.md).

At its end a run's 1-minute load average holds the run's own threads (a 2-thread run on 2
cores ends near 2.0), so the end is judged against them: more than ``EXTRA_LOAD`` above the
run's threads means something else ran beside it."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

QUIET_LOAD = 1.5  # load average (1 min) at the start of a run on a quiet machine
LOADED_AT = 2.0  # ... and at its end: at least this (tests/figure_conditions.py holds the same)
EXTRA_LOAD = 0.5  # ... or, for a run of more threads, this much above its own thread count
_SIMD = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni",
         "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "avx_vnni", "neon", "asimd",
         "sve")  # fmt: skip
_PACKAGES = ("edgeinfer", "numpy", "onnxruntime", "llama_cpp_python", "tokenizers", "llguidance")


def cpu() -> dict[str, Any]:
    """The CPU's model name and the SIMD flags that pick kernels (Linux /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and model in ("", platform.machine()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "simd": [f for f in _SIMD if f in flags], "cores": os.cpu_count()}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def wait_quiet(limit_s: float = 240.0) -> None:
    """Wait (at most ``limit_s``) for the 1-minute load to fall under ``QUIET_LOAD``: a run
    started right after another would otherwise start loaded by the first one's threads."""
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] >= QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(5)


def start(threads: int | None, rounds: int, *, wait: bool = True) -> dict[str, Any]:
    """The conditions at the start of a run (after ``wait_quiet`` unless ``wait`` is off);
    ``finish`` adds the load at its end."""
    if wait:
        wait_quiet()
    load = os.getloadavg()
    return {
        "command": shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "cpu": cpu(),
        "platform": platform.platform(),
        "versions": versions(),
        "threads": threads,
        "rounds": rounds,
        "load_before": list(load),
        "quiet": load[0] < QUIET_LOAD,
    }


def finish(conditions: dict[str, Any]) -> dict[str, Any]:
    load = os.getloadavg()
    conditions["load_after"] = list(load)
    own = conditions.get("threads") or os.cpu_count() or 1
    limit = max(LOADED_AT, own + EXTRA_LOAD)
    conditions["end_limit"] = limit
    conditions["quiet"] = bool(conditions["quiet"]) and load[0] < limit
    if not conditions["quiet"]:
        conditions["label"] = "loaded: no target is declared met from this run"
    return conditions


def write(path: Path, record: dict[str, Any]) -> None:
    """``record`` as ``path``'s JSON, whole or not at all: written beside it, then moved
    over it, so an interrupted run leaves the previous file as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)
