"""The conditions a benchmark ran under, recorded the same way in every results file that
uses it: the command, the machine (CPU model and SIMD flags), versions, threads, rounds and
the load average before and after. A figure taken above ``QUIET_LOAD`` is labelled loaded
and declares no target met (shared/BENCHMARKS.md)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from importlib import metadata
from typing import Any

QUIET_LOAD = 1.5  # load average (1 min) at the start of a run on a quiet machine
LOADED_AT = 2.0  # ... and at its end, on 2 cores (tests/figure_conditions.py holds the same)
_SIMD = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni",
         "avx512_bf16", "amx_tile", "amx_int8", "avx_vnni", "neon", "asimd", "sve")  # fmt: skip
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


def start(threads: int | None, rounds: int) -> dict[str, Any]:
    """The conditions at the start of a run; ``finish`` adds the load at its end."""
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
    conditions["quiet"] = bool(conditions["quiet"]) and load[0] < LOADED_AT
    if not conditions["quiet"]:
        conditions["label"] = "loaded: no target is declared met from this run"
    return conditions
