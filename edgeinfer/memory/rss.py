"""The process's resident set, measured: its peak, and now with mapped model files in full.

``peak_rss`` is what a plan bounds (``VmHWM``, what the kernel's OOM killer weighs) and what
every generation's stats report; ``resident_with_mapped_files`` is what ``memory.FitAtLoad``
measures once the engine holds the weights.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

import psutil

__all__ = ["peak_rss", "release_free_heap", "resident_with_mapped_files"]


def release_free_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``); nothing
    elsewhere. Parsing a tokenizer or an ONNX graph frees tens of MB that glibc keeps
    resident otherwise, and the peak a plan bounds grows on top of them (the default model's
    ONNX route at 2048: 328.5 MB peak before, ``benchmarks/results/onnx_memory_kv16.json``;
    306.3 MB after, ``benchmarks/results/onnx_memory_trim.json``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return None


def peak_rss() -> int:
    """The process's peak resident set size in bytes (Linux VmHWM), 0 if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        info = psutil.Process().memory_info()
        peak = getattr(info, "peak_wset", None)  # Windows
        if peak:
            return int(peak)
        import resource

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(maxrss if sys.platform == "darwin" else maxrss * 1024)
    except (ImportError, OSError, psutil.Error):
        return 0


def resident_with_mapped_files(files: tuple[str, ...]) -> int | None:
    """This process's resident set now, with ``files``' mappings counted at their full size.

    An engine maps its weights file and reads it lazily: a page becomes resident when a
    kernel first reads it (an embedding row when its token first appears), so the weights
    count in full although some are not resident yet. Linux only (``/proc/self/smaps``);
    None elsewhere.
    """
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    rss = mapped_rss = mapped_size = 0
    in_file = False
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode path
            in_file = len(fields) >= 6 and " ".join(fields[5:]) in files
        elif fields[0] == "Rss:":
            rss += int(fields[1]) * 1024
            mapped_rss += int(fields[1]) * 1024 if in_file else 0
        elif fields[0] == "Size:" and in_file:
            mapped_size += int(fields[1]) * 1024
    return rss - mapped_rss + mapped_size
