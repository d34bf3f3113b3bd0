"""JSON from strangers, parsed with bounds: one function per place JSON enters.

Python's ``json`` accepts documents that the rest of a program cannot hold: nesting deep
enough to exhaust the stack of whatever walks it next, integers with thousands of digits
(``int()`` refuses past 4,300 and arithmetic on them is slow), and ``\\ud800`` escapes that
decode to lone surrogates, which no UTF-8 encoder, tokenizer or native library accepts.
Every JSON edge (HTTP bodies, device-service lines, model folders' config files, bench
results) goes through :func:`parse_json` or :func:`read_json_file`, which refuse such
documents with the caller's error type and a message naming the field.

Bounds: bytes (the caller's), depth (``max_depth`` containers), number literals
(``max_number_chars`` characters), and strings that are not valid Unicode scalar values.
``NaN`` and ``Infinity`` literals are refused: they are not JSON.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from edgeinfer.errors import EdgeInferError, InvalidRequestError, ModelLoadError

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_NUMBER_CHARS",
    "open_regular",
    "parse_json",
    "read_json_file",
    "read_regular_file",
]

DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_NUMBER_CHARS = 64  # int64 has 19 digits; a float's repr at most 24 characters

# A string literal (with escapes) or a bracket: strings are skipped so brackets inside them
# do not count toward the depth.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)

# Lone surrogates can only come from \u escapes (the raw bytes were checked as UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class _Unholdable:
    """A number literal Python cannot hold sensibly, kept until the walk names its field."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def parse_json(
    data: bytes | str,
    *,
    what: str,
    error: type[EdgeInferError] = InvalidRequestError,
    max_bytes: int | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_number_chars: int = DEFAULT_MAX_NUMBER_CHARS,
) -> Any:
    """Decode one JSON document (UTF-8 bytes or text) within bounds, or raise ``error``.

    ``what`` names the input in messages ("the request body", "genai_config.json"); a bad
    field is named by its path inside it (``messages[2].content``).
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if max_bytes is not None and len(raw) > max_bytes:
        raise error(f"{what} is {len(raw):,} bytes; at most {max_bytes:,} are accepted")
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 (bad byte at offset {exc.start}); send UTF-8") from exc
    _check_depth(raw, what, error, max_depth)

    unholdable = 0

    def too_long(literal: str) -> _Unholdable:
        nonlocal unholdable
        unholdable += 1
        return _Unholdable(
            f"is a number of {len(literal):,} characters; at most {max_number_chars} are accepted"
        )

    def integer(literal: str) -> Any:
        return int(literal) if len(literal) <= max_number_chars else too_long(literal)

    def real(literal: str) -> Any:
        nonlocal unholdable
        if len(literal) > max_number_chars:
            return too_long(literal)
        value = float(literal)
        if math.isfinite(value):
            return value
        unholdable += 1
        return _Unholdable(f"({literal}) is out of range")

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON value")

    try:
        value = json.loads(text, parse_int=integer, parse_float=real, parse_constant=constant)
    except RecursionError as exc:
        raise error(f"{what} is nested too deeply (at most {max_depth} levels)") from exc
    except ValueError as exc:
        raise error(f"{what} is not JSON: {exc}") from exc
    if unholdable or _SURROGATE_ESCAPE.search(raw):  # the walk is needed only then
        _check_values(value, what, error)
    return value


def _check_depth(raw: bytes, what: str, error: type[EdgeInferError], max_depth: int) -> None:
    depth = 0
    for match in _TOKENS.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise error(f"{what} is nested deeper than {max_depth} levels")
        elif token in (b"]", b"}"):
            depth -= 1


def _check_values(value: Any, what: str, error: type[EdgeInferError]) -> None:
    """Walk the decoded value (iteratively) for unholdable numbers and lone surrogates.

    Paths are kept as (parent, key) links and spelled out only for the message.
    """
    pending: list[tuple[Any, Any]] = [(value, None)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, (where, key), what, error)
                pending.append((child, (where, key)))
        elif isinstance(item, list):
            pending.extend((child, (where, i)) for i, child in enumerate(item))
        elif isinstance(item, str):
            _check_text(item, where, what, error)
        elif isinstance(item, _Unholdable):
            raise error(f"{_field(where, what)} {item.reason}")


def _check_text(text: str, where: Any, what: str, error: type[EdgeInferError]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(
            f"{_field(where, what)} holds a lone surrogate (\\u{ord(text[exc.start]):04x}), "
            "which is not a character; send valid Unicode"
        ) from None


def _field(where: Any, what: str) -> str:
    """``messages[2].content in the request body`` from the (parent, key) links."""
    parts: list[str] = []
    while where is not None:
        where, key = where
        if isinstance(key, int):
            parts.append(f"[{key}]")
        else:
            shown = key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            parts.append(f".{shown[:64]}")
    path = "".join(reversed(parts)).lstrip(".")
    return f"{path} in {what}" if path else what


def open_regular(path: Path, *, error: type[EdgeInferError], what: str = "") -> int:
    """A read-only descriptor of ``path``, refused unless it is a regular file: the type is
    checked on the opened descriptor (opened non-blocking, so a FIFO cannot hang the open),
    which leaves no window between the check and the read. ``what`` names the file in
    messages ("input file")."""
    name = f"{what} {path}" if what else str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as exc:
        raise error(f"{name} does not exist") from exc
    except OSError as exc:
        raise error(f"cannot open {name}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{name} is not a regular file")
    return fd


def read_regular_file(path: Path, *, max_bytes: int, error: type[EdgeInferError]) -> bytes:
    """Read a regular file of at most ``max_bytes``; refuse FIFOs, devices and folders.

    The type is checked on the opened descriptor (opened non-blocking, so a FIFO cannot hang
    the open), which leaves no window between the check and the read.
    """
    fd = open_regular(path, error=error)
    try:
        info = os.fstat(fd)
        if info.st_size > max_bytes:
            raise error(f"{path} is {info.st_size:,} bytes; at most {max_bytes:,} are accepted")
        chunks = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise error(f"{path} grew past {max_bytes:,} bytes while it was read")
        return data
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def read_json_file(
    path: Path,
    *,
    max_bytes: int = 1 << 20,
    error: type[EdgeInferError] = ModelLoadError,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """A JSON file from a stranger's folder: regular, bounded in size, parsed with bounds."""
    data = read_regular_file(path, max_bytes=max_bytes, error=error)
    return parse_json(data, what=str(path), error=error, max_depth=max_depth)
