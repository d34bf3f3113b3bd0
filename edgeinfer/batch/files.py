"""A batch job's input, read as rows within bounds: JSON Lines, or CSV by its suffix.

Every row of the file becomes exactly one Row, an error row if it cannot run, so the job
writes one record per row. A byte-order mark is read as one (UTF-8; UTF-16 for a CSV file);
a CSV cell is text, and so is a CSV id (``007`` is the id "007", not 7). The output side
(locking, appending, resuming) is :mod:`edgeinfer.batch.output`.
"""

from __future__ import annotations

import codecs
import csv
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ..bounded_json import open_regular, parse_json
from ..errors import EdgeInferError, InvalidRequestError
from ..generation.sampling import SamplingConfig
from .records import (
    MAX_ID_CHARS,
    MAX_LINE_BYTES,
    Row,
    bad_row,
    oversized_row,
    parse_line,
    parse_object,
)

__all__ = ["count_lines", "read_rows"]

_UTF8_BOM = codecs.BOM_UTF8
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
_UNREADABLE = "edgeinfer.batch.unreadable"


def _unreadable(exc: UnicodeError) -> tuple[str, int]:
    """Bytes that are not text in the file's encoding become lone surrogates, which spoil
    only their own row (refused there), as surrogateescape does for UTF-8."""
    assert isinstance(exc, UnicodeDecodeError)
    return "\udcff", exc.end


codecs.register_error(_UNREADABLE, _unreadable)


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
        if f.peek(4)[:2] in _UTF16_BOMS:
            raise InvalidRequestError(
                f"the input {path} is UTF-16 text; JSON Lines are UTF-8: save it as UTF-8"
            )
        for line, raw, too_long in _lines(f):
            if line == 1 and raw.startswith(_UTF8_BOM):
                raw = raw[len(_UTF8_BOM) :]
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
    columns (messages, response_format, ...) read from their text. Bytes that are not text
    spoil only their own row (they are carried as surrogates, and refused there)."""
    with _open_regular(path, "the input") as f:
        utf16 = f.peek(4)[:2] in _UTF16_BOMS
        encoding = "utf-16" if utf16 else "utf-8-sig"  # either takes its BOM off
        errors = _UNREADABLE if utf16 else "surrogateescape"
        text = io.TextIOWrapper(f, encoding=encoding, errors=errors, newline="")
        reader = csv.DictReader(text)
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:  # a cell over csv's field limit (128 KiB), a stray NUL
                yield bad_row(reader.line_num, f"line {reader.line_num}: unreadable CSV: {exc}")
                continue
            yield _csv_row(cells, reader.line_num, base, "UTF-16" if utf16 else "UTF-8")


def _csv_row(cells: dict[str | None, Any], line: int, base: SamplingConfig, encoding: str) -> Row:
    """The row of one CSV record; a row that cannot run keeps its id cell as its id."""
    obj: dict[str, Any] = {}
    row_id = _csv_id(cells.get("id"))
    for key, cell in cells.items():
        if key is None or not isinstance(cell, str):
            return bad_row(line, f"line {line} has more or fewer cells than the header", row_id)
        if not _is_text(key) or not _is_text(cell):
            return bad_row(line, f"line {line} is not {encoding} text", row_id)
        if cell == "":
            continue
        try:
            obj[key] = _csv_cell(key, cell, line)
        except (ValueError, EdgeInferError) as exc:
            return bad_row(line, f"line {line} {key}: {exc}", row_id)
    return parse_object(obj, line, base)


def _csv_id(cell: Any) -> str | None:
    """The id cell's text, when it is an id (the row's own check says why it is not)."""
    ok = isinstance(cell, str) and 0 < len(cell) <= MAX_ID_CHARS and _is_text(cell)
    return cell if ok else None


def _csv_cell(key: str, cell: str, line: int) -> Any:
    if key in _CSV_INTS:  # a bad number is refused by its field's check
        digits = cell.isascii() and cell.lstrip("-").isdigit() and len(cell) <= 20
        return int(cell) if digits else cell
    if key in _CSV_FLOATS:
        return float(cell) if len(cell) <= 64 else cell
    if key in _CSV_JSON:
        return parse_json(cell, what=f"line {line} {key}")
    return cell  # the id among them: its text, "007" as written


def _is_text(text: str) -> bool:
    """Whether ``text`` came whole from the file (no surrogate stands for a bad byte)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
