"""How much of this machine's CPU is ours: the cores this process may use and the cores other
processes keep busy, and from those the number of compute threads.

Why it matters: llama.cpp's compute threads meet at a barrier after every operation of the
graph (hundreds per token), and ONNX Runtime's intra-op threads do the same per operator.
When one of them is descheduled because another process holds its core, the others wait
for it at each barrier: on a 2-core machine with one core busy, 2 threads decoded at 26-32
tok/s where 1 thread decoded at 69 (``shared/notes/batching.md``). So the default thread
count is the usable cores less the cores others keep busy, never below one.

Usable cores: the physical cores, capped by the process's CPU affinity (``taskset``,
``cpuset``) and by a container's CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``
over ``cpu.cfs_period_us``). Busy: the CPU time the kernel counted on the usable CPUs over
a short window, less this process's own, per second of wall time (so our own compute
threads never count as someone else's load).

The parsers are pure functions of the files' text, tested against recorded files; ``CpuMeter``
reads the live counters.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

__all__ = [
    "BUSY_CORE_THRESHOLD",
    "CpuMeter",
    "CpuShare",
    "ThreadTuner",
    "busy_line",
    "busy_record",
    "cgroup_quota_cores",
    "cpu_share",
    "threads_for",
    "usable_cores",
]

# A core counts as taken when others keep it busy at least this fraction of the time.
BUSY_CORE_THRESHOLD = 0.5
SAMPLE_S = 0.1  # the window of the sample taken when a model loads
RECHECK_S = 1.0  # the shortest window a re-check between requests measures over
_MAX_TEXT = 4096  # bytes read from a cgroup file: its value is one short line
# a cgroup quota or period in microseconds, -1 for none (the kernel caps both far below 15 digits)
_DURATION = re.compile(r"-?[0-9]{1,15}")


@dataclass(frozen=True)
class CpuShare:
    """What this process may compute with now (cores are counted in whole CPUs)."""

    usable: int  # cores this process may use: physical, affinity and quota together
    busy: float  # cores other processes kept busy over the window (0.0 .. usable CPUs)
    threads: int  # compute threads to use: usable less the busy cores, at least 1
    window_s: float  # the window the busy figure was measured over

    @property
    def why(self) -> str:
        return (
            f"{self.threads} thread{'s' if self.threads != 1 else ''}: other processes kept "
            f"{self.busy:.1f} of {self.usable} usable cores busy over {self.window_s:.2f} s"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "usable_cores": self.usable,
            "busy_cores": round(self.busy, 2),
            "threads": self.threads,
            "why": self.why,
        }


def threads_for(usable: int, busy: float) -> int:
    """Threads for ``usable`` cores when others keep ``busy`` cores busy: one per core not
    taken (a core is taken from ``BUSY_CORE_THRESHOLD`` of its time on), at least one."""
    taken = math.floor(busy + (1.0 - BUSY_CORE_THRESHOLD)) if busy > 0 else 0
    return max(1, usable - taken)


def cgroup_quota_cores(max_text: str | None = None, *, quota: str | None = None,
                       period: str | None = None) -> float | None:  # fmt: skip
    """CPUs a container's quota allows, or None without a quota. ``max_text``: cgroup v2
    ``cpu.max`` ("max 100000" or "150000 100000"); or v1 ``quota`` (``cpu.cfs_quota_us``,
    -1 without) and ``period`` (``cpu.cfs_period_us``)."""
    if max_text is not None:
        fields = max_text.split()
        if len(fields) != 2 or fields[0] == "max":
            return None
        quota, period = fields
    if quota is None or period is None:
        return None
    q, p = _microseconds(quota), _microseconds(period)
    if q is None or p is None or q <= 0 or p <= 0:
        return None
    return q / p


def _microseconds(text: str) -> int | None:
    """A cgroup duration (a decimal integer of microseconds), bounded; None otherwise."""
    text = text.strip()
    return int(text) if _DURATION.fullmatch(text) else None


def usable_cores(physical: int | None, affinity: int | None, quota: float | None) -> int:
    """Cores to compute on: physical cores (hyper-threads share a core's units), capped by
    the CPUs the process may run on and by a container's quota (rounded up: 1.5 CPUs lets
    two threads run half the time each), at least one."""
    n = physical or affinity or 1
    if affinity:
        n = min(n, affinity)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return max(1, n)


def own_cgroup_quota(read: Callable[[str], str | None]) -> float | None:
    """The CPU quota of this process's cgroup from ``read(path)`` (None if unreadable):
    v2 (the ``0::/path`` line of /proc/self/cgroup), else v1 (the ``cpu`` controller)."""
    table = read("/proc/self/cgroup") or ""
    for line in table.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.strip().rstrip("/")
        if controllers == "" and parts[0] == "0":
            found = cgroup_quota_cores(read(f"/sys/fs/cgroup{path}/cpu.max"))
        elif "cpu" in controllers.split(","):
            base = f"/sys/fs/cgroup/{controllers}{path}"
            found = cgroup_quota_cores(
                quota=read(f"{base}/cpu.cfs_quota_us"), period=read(f"{base}/cpu.cfs_period_us")
            )
        else:
            continue
        if found is not None:
            return found
    return None


def _read_small(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read(_MAX_TEXT)
    except OSError:
        return None


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return None


def _busy_seconds(cpus: set[int] | None) -> float:
    """CPU seconds the kernel counted as busy (everything but idle and I/O wait) on ``cpus``."""
    total = 0.0
    for i, t in enumerate(psutil.cpu_times(percpu=True)):
        if cpus is not None and i not in cpus:
            continue
        busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0)
        total += busy + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
    return total


def _own_seconds(process: psutil.Process) -> float:
    t = process.cpu_times()
    return t.user + t.system


class CpuMeter:
    """Others' CPU use between two reads of the kernel's counters (no sleeping between)."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        cpus = _affinity()
        self._cpus = cpus
        quota = own_cgroup_quota(_read_small)
        self.usable = usable_cores(
            psutil.cpu_count(logical=False), len(cpus) if cpus else os.cpu_count(), quota
        )
        self._mark = self._now()

    def _now(self) -> tuple[float, float, float]:
        return time.monotonic(), _busy_seconds(self._cpus), _own_seconds(self._process)

    def elapsed(self) -> float:
        return time.monotonic() - self._mark[0]

    def share(self) -> CpuShare:
        """The share since the last call (or since the meter was made), and a new window."""
        now = self._now()
        (t0, busy0, own0), (t1, busy1, own1) = self._mark, now
        self._mark = now
        wall = max(t1 - t0, 1e-6)
        n_cpus = len(self._cpus) if self._cpus else (os.cpu_count() or 1)
        others = min(float(n_cpus), max(0.0, (busy1 - busy0) - (own1 - own0)) / wall)
        return CpuShare(self.usable, others, threads_for(self.usable, others), wall)


class ThreadTuner:
    """Re-measures the share between requests, over at least ``RECHECK_S`` since the last
    look, and says when the thread count should change (a backend that can change it
    between requests, llama.cpp, applies it)."""

    def __init__(self, threads: int, recheck_s: float = RECHECK_S) -> None:
        self._meter = CpuMeter()
        self._recheck_s = recheck_s
        self.threads = threads
        self.last: CpuShare | None = None

    def check(self) -> int | None:
        """The new thread count if it changed since the last look, else None."""
        if self._meter.elapsed() < self._recheck_s:
            return None
        self.last = self._meter.share()
        if self.last.threads == self.threads:
            return None
        self.threads = self.last.threads
        return self.threads


def cpu_share(window_s: float = SAMPLE_S) -> CpuShare:
    """This process's share of the CPU now, measured over ``window_s`` seconds."""
    meter = CpuMeter()
    time.sleep(window_s)
    return meter.share()


def busy_line(share: CpuShare, loadavg: Iterable[float] | None = None) -> str:
    """One line saying how busy the machine is, for ``bench`` and ``devices``."""
    load = tuple(loadavg) if loadavg is not None else os.getloadavg()
    head = f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    if share.threads >= share.usable:
        return f"{head}; other processes kept {share.busy:.1f} of {share.usable} usable cores busy"
    return (
        f"{head}; BUSY: other processes kept {share.busy:.1f} of {share.usable} usable cores "
        f"busy, so the default is {share.threads} compute thread"
        f"{'s' if share.threads != 1 else ''} (threads=N overrides; speeds measured now are "
        "lower than on an idle machine)"
    )


def busy_record(window_s: float = 0.25) -> dict[str, Any]:
    """How busy the machine is now, as JSON: the share, the load average and the line."""
    share = cpu_share(window_s)
    load = os.getloadavg()
    return {**share.to_dict(), "loadavg": [round(x, 2) for x in load],
            "line": busy_line(share, load)}  # fmt: skip
