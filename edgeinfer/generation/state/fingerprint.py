"""What makes a KV cache valid, as a dict a snapshot header carries: the model's bytes (sha256),
the backend, its engine version and build, the machine's instruction-set family (the kernels an
engine picks, so the sums it makes), and the backend's KV layout and settings.

Hashing a 100 MB model takes a few tenths of a second, so a file's sha256 is remembered per
(path, device, inode, size, mtime, ctime), in this process and in
``$EDGEINFER_HOME/cache/sha256/``. The ctime is what no user call can set: a file rewritten in
place, even to the same size with its mtime put back (``os.utime``), gets a new one, and is
hashed again.

Thread counts are not part of it: both engines split a matrix product's output rows between
threads, never one sum, so the KV is the same bits at any count (``tests/test_state_fingerprint.py``
checks this on both engines).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from edgeinfer.bounded_json import read_json_file
from edgeinfer.errors import EdgeInferError
from edgeinfer.files.catalog import edgeinfer_home

__all__ = ["engine_build", "file_sha256", "fingerprint", "machine", "model_sha256", "simd_family"]

logger = logging.getLogger(__name__)

Stamp = tuple[str, int, int, int, int, int]  # path, device, inode, size, mtime_ns, ctime_ns

_known: dict[Stamp, str] = {}
_lock = threading.Lock()
_MAX_FOLDER_FILES = 64
_MAX_BUILD_CHARS = 400


def _stamp(path: Path) -> Stamp:
    st = os.stat(path)
    resolved = str(path.resolve())
    return (resolved, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _record_path(stamp: Stamp) -> Path:
    key = hashlib.sha256(stamp[0].encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return edgeinfer_home() / "cache" / "sha256" / f"{key}.json"


def _remembered(stamp: Stamp) -> str | None:
    record = _record_path(stamp)
    if not record.is_file():
        return None
    try:
        value = read_json_file(record, max_bytes=4096, error=EdgeInferError)
    except EdgeInferError:
        return None
    if isinstance(value, dict) and value.get("stamp") == list(stamp):
        digest = value.get("sha256")
        if isinstance(digest, str) and len(digest) == 64:
            return digest
    return None


def _remember(stamp: Stamp, digest: str) -> None:
    record = _record_path(stamp)
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"stamp": list(stamp), "sha256": digest}))
        os.replace(tmp, record)
    except OSError as exc:  # the hash is computed again next time
        logger.debug("cannot remember the sha256 of %s: %s", stamp[0], exc)
        tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    """The sha256 of ``path``'s bytes, computed once per (path, device, inode, size, mtime,
    ctime)."""
    stamp = _stamp(path)
    with _lock:
        digest = _known.get(stamp) or _remembered(stamp)
        if digest is None:
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            digest = h.hexdigest()
            _remember(stamp, digest)
        _known[stamp] = digest
    return digest


def model_sha256(path: Path) -> str:
    """The sha256 of a model: its file's, or for a folder, of every regular file in it (names
    and hashes, sorted)."""
    if not path.is_dir():
        return file_sha256(path)
    entries = sorted(p for p in path.iterdir() if p.is_file() and not p.is_symlink())
    h = hashlib.sha256()
    for entry in entries[:_MAX_FOLDER_FILES]:
        h.update(f"{entry.name}\0{file_sha256(entry)}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def simd_family(arch: str, features: tuple[str, ...] | list[str]) -> str:
    """The widest vector instruction set of a CPU: ``x86_64/avx512``, ``arm64/neon``, ..."""
    names = set(features)
    if arch == "x86_64":
        order = [("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx"), ("sse4.2", "sse4.2")]
    elif arch == "arm64":
        order = [("sve2", "sve2"), ("sve", "sve"), ("neon", "neon")]
    else:
        order = []
    family = next((name for name, flag in order if flag in names), "scalar")
    return f"{arch}/{family}"


def machine() -> dict[str, str]:
    """This machine's part of a fingerprint: its SIMD family and the CPU features that pick
    kernels (read from /proc/cpuinfo, sysctl or the registry: no network)."""
    from edgeinfer.machine.inventory import devices

    inventory = devices(engines=())
    return {
        "simd": simd_family(inventory.arch, inventory.cpu_features),
        "cpu_features": ",".join(sorted(inventory.cpu_features)),
    }


def engine_build(backend: str) -> str:
    """What the engine library was built with and picked at run time (llama.cpp's system
    info; onnxruntime's build info), at most ``_MAX_BUILD_CHARS`` characters."""
    try:
        if backend == "llama.cpp":
            import llama_cpp

            raw = llama_cpp.llama_print_system_info()
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        elif backend == "onnxruntime":
            import onnxruntime

            text = str(onnxruntime.get_build_info())
        else:
            return "unknown"
    except Exception as exc:  # an engine without the call: the version stands alone
        logger.debug("cannot read %s's build info: %s", backend, exc)
        return "unknown"
    text = " ".join(text.split())
    if len(text) <= _MAX_BUILD_CHARS:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[: _MAX_BUILD_CHARS - 30]}... sha256:{digest}"


def fingerprint(model_path: Path, backend_info: dict[str, Any], layout: dict[str, Any]) -> dict:
    """The fingerprint a snapshot of this model, backend and KV layout carries."""
    backend = str(backend_info.get("backend"))
    return {
        "model_sha256": model_sha256(model_path),
        "backend": backend,
        "engine_version": str(backend_info.get("engine_version")),
        "engine_build": engine_build(backend),
        "provider": str(backend_info.get("provider")),
        **machine(),
        "layout": layout,
    }
