"""The KV snapshot file: one sequence's tokens and KV cache, fingerprinted, checksummed.

Layout (integers little-endian)::

    magic      8 bytes  b"EIKVSNAP"
    version    u32      FORMAT_VERSION
    header     u32 n, then n bytes of JSON (n <= MAX_HEADER_BYTES)
    check      32 bytes sha256 of the header's JSON bytes
    payload    header["payload_bytes"] bytes: the backend's KV of the sequence
    (nothing after it)

The header holds ``fingerprint`` (everything that makes the KV valid: model file sha256,
backend and engine version, KV layout and dtype, context, settings that change the numbers),
``tokens`` (the ids whose KV the payload holds), ``reusable`` (how many of them a later prompt
may reuse: those written by prefill) and the payload's size and sha256. A reader checks the
magic, version, header size, header checksum, the fingerprint and the payload size the
backend expects for that many tokens before a byte of payload reaches the engine, and the
payload checksum while reading it.

Writes are atomic: a temporary file in the same folder, fsync, rename; a failed write (a full
disk) removes the temporary file and raises ``SnapshotError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.bounded_json import open_regular, parse_json
from edgeinfer.errors import SnapshotError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "Header",
    "PayloadReader",
    "read_header",
    "write_snapshot",
]

MAGIC = b"EIKVSNAP"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 8 << 20  # token ids as JSON: ~7 bytes each, a million tokens at most
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_CHECK = 32
_READ_BLOCK = 4 << 20


@dataclass(frozen=True)
class Header:
    """What a snapshot holds, read and checked from its header."""

    fingerprint: dict[str, Any]
    tokens: tuple[int, ...]
    reusable: int  # leading tokens a later prompt may reuse (written by prefill)
    payload_bytes: int
    payload_sha256: str
    payload_offset: int  # where the payload starts in the file


def write_snapshot(
    path: Path,
    fingerprint: dict[str, Any],
    tokens: Sequence[int],
    reusable: int,
    payload: Iterable[memoryview | bytes | bytearray],
) -> int:
    """Write a snapshot atomically; its size in bytes. ``payload`` is the KV in parts (read
    twice: for the checksum, then to write). SnapshotError when it cannot be written."""
    parts = [memoryview(p).cast("B") for p in payload]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    size = sum(p.nbytes for p in parts)
    header = {
        "fingerprint": fingerprint,
        "tokens": [int(t) for t in tokens],
        "reusable": int(reusable),
        "payload_bytes": size,
        "payload_sha256": digest.hexdigest(),
    }
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise SnapshotError(f"cannot write {path}: {len(tokens)} tokens is too many to snapshot")
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw)) + raw + hashlib.sha256(raw).digest()
    _atomic_write(path, [memoryview(head), *parts])
    return len(head) + size


def _atomic_write(path: Path, parts: list[memoryview]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for part in parts:
                view = part
                while view.nbytes:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise SnapshotError(
            f"cannot write the snapshot {path}: {exc.strerror or exc} (a full disk or no "
            "permission?); nothing was left behind"
        ) from exc


def open_snapshot(path: Path) -> int:
    """A read descriptor of ``path``: a regular file, not followed through a symlink."""
    if path.is_symlink():
        raise SnapshotError(f"{path} is a symlink; snapshots are read from regular files only")
    return open_regular(path, error=SnapshotError, what="snapshot")


def read_header(fd: int, path: Path, file_size: int | None = None) -> Header:
    """The checked header of the snapshot open at ``fd`` (positioned at 0); SnapshotError
    naming ``path`` when it is not a snapshot, is truncated or its header is corrupt."""
    size = os.fstat(fd).st_size if file_size is None else file_size
    prefix = _read_exact(fd, _PREFIX.size, path)
    magic, version, n = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise SnapshotError(f"{path} is not an edgeinfer KV snapshot")
    if version != FORMAT_VERSION:
        raise SnapshotError(
            f"{path} is a snapshot of format {version}; this edgeinfer reads format "
            f"{FORMAT_VERSION} — make it again"
        )
    if not 2 <= n <= MAX_HEADER_BYTES or _PREFIX.size + n + _CHECK > size:
        raise SnapshotError(f"{path}: the snapshot header is corrupt or the file is truncated")
    raw = _read_exact(fd, n, path)
    if hashlib.sha256(raw).digest() != _read_exact(fd, _CHECK, path):
        raise SnapshotError(f"{path}: the snapshot header is corrupt (checksum mismatch)")
    header = _checked_header(parse_json(raw, what=str(path), error=SnapshotError), path)
    offset = _PREFIX.size + n + _CHECK
    if size != offset + header["payload_bytes"]:
        raise SnapshotError(
            f"{path}: the file holds {size - offset} bytes of KV but its header says "
            f"{header['payload_bytes']}; it is truncated or was changed"
        )
    return Header(
        fingerprint=header["fingerprint"],
        tokens=tuple(header["tokens"]),
        reusable=header["reusable"],
        payload_bytes=header["payload_bytes"],
        payload_sha256=header["payload_sha256"],
        payload_offset=offset,
    )


def _checked_header(value: Any, path: Path) -> dict[str, Any]:
    def bad(what: str) -> SnapshotError:
        return SnapshotError(f"{path}: the snapshot header is invalid: {what}")

    if not isinstance(value, dict):
        raise bad("not an object")
    if not isinstance(value.get("fingerprint"), dict):
        raise bad("no fingerprint")
    tokens = value.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise bad("no tokens")
    if not all(type(t) is int and 0 <= t < 1 << 31 for t in tokens):
        raise bad("tokens must be non-negative integers")
    reusable = value.get("reusable")
    if type(reusable) is not int or not 0 <= reusable <= len(tokens):
        raise bad("reusable must be a count of its tokens")
    size = value.get("payload_bytes")
    if type(size) is not int or size <= 0:
        raise bad("payload_bytes must be a positive integer")
    digest = value.get("payload_sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        raise bad("payload_sha256 must be 64 hex digits")
    return value


class PayloadReader:
    """Fills the caller's buffers, in order, from a snapshot's payload (the KV lands in
    place), hashing as it goes; ``verify`` checks that all of it was read and its sha256."""

    def __init__(self, fd: int, header: Header, path: Path) -> None:
        self._fd, self._path = fd, path
        self._left = header.payload_bytes
        self._want = header.payload_sha256
        self._digest = hashlib.sha256()
        os.lseek(fd, header.payload_offset, os.SEEK_SET)

    def __call__(self, buffer: memoryview) -> None:
        view = buffer.cast("B")
        if view.nbytes > self._left:
            raise SnapshotError(f"{self._path}: the payload is shorter than this model's KV needs")
        done = 0
        while done < view.nbytes:
            n = os.readv(self._fd, [view[done : done + _READ_BLOCK]])
            if n == 0:
                raise SnapshotError(f"{self._path} is truncated")
            done += n
        self._digest.update(view)
        self._left -= view.nbytes

    def verify(self) -> None:
        if self._left != 0:
            raise SnapshotError(f"{self._path}: the payload is longer than this model's KV needs")
        if self._digest.hexdigest() != self._want:
            raise SnapshotError(f"{self._path}: the snapshot's KV is corrupt (checksum mismatch)")


def _read_exact(fd: int, n: int, path: Path) -> bytes:
    data = b""
    while len(data) < n:
        block = os.read(fd, n - len(data))
        if not block:
            raise SnapshotError(f"{path} is truncated (or not an edgeinfer KV snapshot)")
        data += block
    return data
