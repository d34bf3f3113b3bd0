"""What makes a KV cache valid, as a dict a snapshot header carries: the model's bytes (sha256),
the backend and its engine version, and the backend's KV layout and settings.

Hashing a 100 MB model takes a few tenths of a second, so a file's sha256 is remembered per
(path, size, mtime, inode), in this process and in ``$EDGEINFER_HOME/cache/sha256/``.
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
from edgeinfer.catalog import edgeinfer_home
from edgeinfer.errors import EdgeInferError

__all__ = ["file_sha256", "model_sha256"]

logger = logging.getLogger(__name__)

_known: dict[tuple[str, int, int, int], str] = {}
_lock = threading.Lock()
_MAX_FOLDER_FILES = 64


def _stamp(path: Path) -> tuple[str, int, int, int]:
    st = os.stat(path)
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def _record_path(stamp: tuple[str, int, int, int]) -> Path:
    key = hashlib.sha256(stamp[0].encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return edgeinfer_home() / "cache" / "sha256" / f"{key}.json"


def _remembered(stamp: tuple[str, int, int, int]) -> str | None:
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


def _remember(stamp: tuple[str, int, int, int], digest: str) -> None:
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
    """The sha256 of ``path``'s bytes, computed once per (path, size, mtime, inode)."""
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


def fingerprint(model_path: Path, backend_info: dict[str, Any], layout: dict[str, Any]) -> dict:
    """The fingerprint a snapshot of this model, backend and KV layout carries."""
    return {
        "model_sha256": model_sha256(model_path),
        "backend": str(backend_info.get("backend")),
        "engine_version": str(backend_info.get("engine_version")),
        "provider": str(backend_info.get("provider")),
        "layout": layout,
    }
