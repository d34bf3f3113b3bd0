"""A batch job's files: the input read as rows within bounds, and the output appended so that
no crash can damage a line already written.

The output is only ever appended, whole lines at a time with one ``os.write`` each batch, so
a killed process leaves at most one torn last line, which :func:`recover` cuts off before a
job resumes. Written lines reach the kernel at once (a SIGKILL cannot lose them); ``fsync``
runs at most once a second and at the end, for power loss.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ..bounded_json import open_regular, parse_json
from ..errors import EdgeInferError, InvalidRequestError
from ..sampling import SamplingConfig
from .records import (
    MAX_LINE_BYTES,
    Row,
    bad_row,
    oversized_row,
    parse_line,
    parse_object,
    row_key,
)

__all__ = ["OutputFile", "count_lines", "read_rows", "recover"]

log = logging.getLogger(__name__)

_SYNC_EVERY_S = 1.0
_MAX_RECORD_BYTES = 64 << 20  # a record holds one reply; a longer line is not a record
_RECORD_DEPTH = 80  # a record holds `parsed`, whose depth the structured-output bounds limit


def _open_regular(path: Path, what: str) -> BinaryIO:
    """``path`` opened for reading, refused unless it is a regular file (checked on the open
    descriptor, so a FIFO cannot hang the open and nothing can swap the file in between)."""
    fd = open_regular(path, error=InvalidRequestError, what=what)
    return os.fdopen(fd, "rb")


def count_lines(path: Path) -> int:
    """Lines in the input (for the progress bar's total), or 0 if it cannot be read."""
    try:
        with _open_regular(path, "the input") as f:
            n, last = 0, b"\n"
            while chunk := f.read(1 << 20):
                n += chunk.count(b"\n")
                last = chunk[-1:]
            return n + (last != b"\n")
    except (EdgeInferError, OSError):
        return 0


def read_rows(path: Path, base: SamplingConfig) -> Iterator[Row]:
    """The rows of a JSON Lines file (or a CSV file, by its ``.csv`` suffix), in order.

    Blank lines are skipped (they still count as lines); every other line becomes a Row,
    an error row if it is bad. Lines longer than MAX_LINE_BYTES are refused unread.
    """
    if path.suffix.lower() == ".csv":
        yield from _csv_rows(path, base)
        return
    with _open_regular(path, "the input") as f:
        for line, raw, too_long in _lines(f):
            if too_long:
                yield oversized_row(line)
            elif raw.strip():
                yield parse_line(raw, line, base)


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, bytes, too long) for each line; a too-long line is skipped in chunks."""
    line = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        line += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield line, b"", True
        else:
            yield line, raw, False


# CSV cells are text; these columns hold numbers or JSON
_CSV_INTS = ("max_tokens", "max_new_tokens", "max_completion_tokens", "top_k", "seed")
_CSV_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
_CSV_JSON = ("messages", "stop", "logit_bias", "response_format", "metadata")


def _csv_rows(path: Path, base: SamplingConfig) -> Iterator[Row]:
    """Rows of a CSV file with a header line; empty cells are left out, numbers and JSON
    columns (messages, response_format, ...) read from their text. Bytes that are not UTF-8
    spoil only their own row (they are carried as surrogates, and refused there)."""
    with _open_regular(path, "the input") as f:
        text = io.TextIOWrapper(f, encoding="utf-8", errors="surrogateescape", newline="")
        reader = csv.DictReader(text)
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:  # a cell over csv's field limit (128 KiB), a stray NUL
                yield bad_row(reader.line_num, f"line {reader.line_num}: unreadable CSV: {exc}")
                continue
            obj = _csv_object(cells, reader.line_num)
            if isinstance(obj, str):
                yield bad_row(reader.line_num, obj)
            else:
                yield parse_object(obj, reader.line_num, base)


def _csv_object(cells: dict[str | None, Any], line: int) -> Any:
    obj: dict[str, Any] = {}
    for key, cell in cells.items():
        if key is None or not isinstance(cell, str):
            return f"line {line} has more or fewer cells than the header"
        if not _is_utf8(key) or not _is_utf8(cell):
            return f"line {line} is not UTF-8"
        if cell == "":
            continue
        try:
            obj[key] = _csv_cell(key, cell, line)
        except (ValueError, EdgeInferError) as exc:
            return f"line {line} {key}: {exc}"
    return obj


def _csv_cell(key: str, cell: str, line: int) -> Any:
    digits = cell.isascii() and cell.lstrip("-").isdigit() and len(cell) <= 20
    if key in _CSV_INTS or key == "id":
        return int(cell) if digits else cell  # a bad number is refused by its field's check
    if key in _CSV_FLOATS:
        return float(cell) if len(cell) <= 64 else cell
    if key in _CSV_JSON:
        return parse_json(cell, what=f"line {line} {key}")
    return cell


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def recover(path: Path) -> Counter[str]:
    """The ids already in the output (counted: an id may appear twice, the second time as a
    duplicate's error record), after cutting off a torn last line a crash left."""
    if not path.exists():
        return Counter()
    done: Counter[str] = Counter()
    with _open_regular(path, "the output") as f:
        good = 0  # bytes of whole lines
        for n, raw in enumerate(iter(lambda: f.readline(_MAX_RECORD_BYTES + 1), b""), start=1):
            if len(raw) > _MAX_RECORD_BYTES:
                _record_key(b"", n, path)  # longer than any record: refused, unread
            if not raw.endswith(b"\n"):
                break
            done[_record_key(raw, n, path)] += 1
            good += len(raw)
        size = f.seek(0, os.SEEK_END)
    if size > good:
        log.warning("%s: cut off a torn last line (%d bytes) a stopped job left", path, size - good)
        with open(path, "r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return done


def _record_key(raw: bytes, n: int, path: Path) -> str:
    what = f"{path} line {n}"
    try:
        record = parse_json(raw, what=what, max_depth=_RECORD_DEPTH)
    except EdgeInferError:
        record = None
    row_id = record.get("id") if isinstance(record, dict) else None
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool) or "error" not in record:
        raise InvalidRequestError(
            f"{what} is not a record of edgeinfer batch; give another output file (the output "
            "is appended to, so that a stopped job resumes)"
        )
    return row_key(row_id)


class OutputFile:
    """The output, opened for appending whole lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._synced = time.monotonic()

    def append(self, lines: list[bytes]) -> None:
        """Write ``lines`` (each ending in a newline) with one write; sync now and then."""
        data = memoryview(b"".join(lines))
        while data:
            data = data[os.write(self._fd, data) :]
        if time.monotonic() - self._synced > _SYNC_EVERY_S:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._fd)
        self._synced = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
