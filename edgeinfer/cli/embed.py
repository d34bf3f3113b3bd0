"""``edgeinfer embed MODEL [-i IN] [-o OUT]``: one embedding per input line, as JSON Lines.

IN (default: standard input) holds one text per line, or with ``--jsonl`` (the default for a
``.jsonl`` file) one JSON object per line with ``text`` and an optional ``id``. Each line of
OUT (default: standard output) is ``{"id", "embedding", "tokens", "truncated"}`` in input
order; a line that cannot be read (not UTF-8, not a JSON object, no text, too long) gets
``{"id", "error"}`` instead and the rest go on. Exit status 1 if any line had an error.
OUT is refused if it is IN (the same file, or a link to it), and a file OUT is written
beside itself and renamed into place once whole: a full disk or Ctrl-C leaves an old OUT
as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import stat
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..batch.output import OutputWriteError, write_failed
from ..bounded_json import parse_json
from ..embedding.batches import MAX_TEXT_CHARS
from ..errors import EdgeInferError, InvalidRequestError
from ..progress import Progress
from .common import MODEL_HELP, add_model_flags, load_model

__all__ = ["add_parser", "cmd_embed"]

_MAX_LINE_BYTES = 4 * MAX_TEXT_CHARS + 1024  # UTF-8: at most 4 bytes a character, + JSON
_CHUNK_ROWS = 256  # rows embedded per call: the progress bar moves, memory stays bounded


@dataclass(frozen=True)
class Row:
    id: Any
    text: str | None
    error: str | None = None


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "embed",
        help="embed texts with an embedding model, one JSON line per input line",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP + " (an embedding model)")
    p.add_argument("-i", "--input", metavar="IN", help="texts, one per line (default: stdin)")
    p.add_argument("-o", "--output", metavar="OUT", help="JSON Lines (default: stdout)")
    p.add_argument(
        "--jsonl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read IN as JSON Lines of {text, id} (default: when IN ends in .jsonl)",
    )
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="L2-normalize the vectors (default: on)",
    )
    p.add_argument("--batch-size", type=int, metavar="N", help="texts per forward pass")
    add_model_flags(p)


def cmd_embed(args: argparse.Namespace) -> int:
    jsonl = args.jsonl if args.jsonl is not None else str(args.input or "").endswith(".jsonl")
    _check_output(args.input, args.output)  # before anything is opened for writing
    with ExitStack() as stack:
        src = _open_input(args.input, stack)
        model = stack.enter_context(load_model(args))
        if model.info.get("kind") != "embedding":
            raise InvalidRequestError(f"{args.model} is not an embedding model; it cannot embed")
        out = stack.enter_context(_output(args.output))
        total = _size(args.input)
        bar = stack.enter_context(Progress("embedding", total))
        errors = 0
        for chunk in _chunks(_rows(src, jsonl, bar)):
            errors += _embed_chunk(model, chunk, out, args)
    if errors:
        print(f"edgeinfer: {errors} line(s) had errors; see their records", file=sys.stderr)
    return 1 if errors else 0


def _open_input(path: str | None, stack: ExitStack) -> IO[bytes]:
    if path is None or path == "-":
        return sys.stdin.buffer
    try:
        return stack.enter_context(Path(path).open("rb"))
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _check_output(src: str | None, out: str | None) -> None:
    """Refuse an OUT that is IN (the same file, a link to it, or both through stdin/stdout)
    or that names a folder."""
    if out is None or out == "-":
        if src not in (None, "-") and _same(os.fstat(sys.stdout.fileno()), src):
            raise InvalidRequestError(f"standard output is the input {src}; write elsewhere")
        return
    if out.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)) or Path(out).is_dir():
        what = "is a folder" if Path(out).is_dir() else f"names a folder (it ends in {out[-1]})"
        raise InvalidRequestError(
            f"the output {out} {what}; give a file, such as {Path(out) / 'embeddings.jsonl'}"
        )
    if not Path(out).parent.is_dir():
        raise InvalidRequestError(f"the output's folder {Path(out).parent} does not exist")
    if src is None or src == "-":
        same = _same(os.fstat(sys.stdin.fileno()), out)
    else:
        same = _same(src, out)
    if same:
        raise InvalidRequestError(f"the output {out} is the input; write the output elsewhere")


def _same(a: os.stat_result | str, b: str) -> bool:
    try:
        one = a if isinstance(a, os.stat_result) else os.stat(a)
        other = os.stat(b)
    except OSError:  # missing (a new output), or not there to compare
        return False
    return (one.st_dev, one.st_ino) == (other.st_dev, other.st_ino)


_STREAMED = "the records before the failure were written"


@contextmanager
def _output(path: str | None) -> Iterator[IO[str]]:
    """Where the records go: stdout; a device or pipe as it is; a file written beside
    itself and renamed into place once whole, so that no failure leaves half of it."""
    if path is None or path == "-":
        with _write_errors("standard output", _STREAMED, stdout=True):
            yield sys.stdout
            sys.stdout.flush()
        return
    if os.path.exists(path) and not os.path.isfile(path):  # /dev/null, /dev/full, a FIFO
        with _write_errors(path, _STREAMED), Path(path).open("w", encoding="utf-8") as f:
            yield f
        return
    target = Path(os.path.realpath(path))  # through a link: the file it names is replaced
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    kept = f"{path} is left as it was" if target.exists() else f"no {path} was left"
    with _write_errors(path, kept):
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            if target.exists():
                os.chmod(partial, stat.S_IMODE(target.stat().st_mode))
            os.replace(partial, target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise


@contextmanager
def _write_errors(name: str, kept: str, *, stdout: bool = False) -> Iterator[None]:
    """An OSError while writing as one OutputWriteError naming the fix (a closed pipe stays
    itself: that is the reader leaving, not an error)."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        if stdout:  # so the interpreter's own flush at exit does not fail again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        raise OutputWriteError(write_failed(name, exc, kept)) from exc


def _size(path: str | None) -> int:
    try:
        return Path(path).stat().st_size if path and path != "-" else 0
    except OSError:
        return 0


def _rows(src: IO[bytes], jsonl: bool, bar: Progress) -> Iterator[Row]:
    number = 0
    while True:
        line = src.readline(_MAX_LINE_BYTES)
        if not line:
            return
        number += 1
        bar.advance(len(line))
        if len(line) == _MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := src.readline(1 << 20)) and not rest.endswith(b"\n"):
                bar.advance(len(rest))
            bar.advance(len(rest))
            yield Row(number, None, f"line {number} is longer than {_MAX_LINE_BYTES:,} bytes")
            continue
        yield _row(number, line.rstrip(b"\r\n"), jsonl)


def _row(number: int, line: bytes, jsonl: bool) -> Row:
    row = _parsed_row(number, line, jsonl)
    if row.text is not None and len(row.text) > MAX_TEXT_CHARS:
        return Row(row.id, None, f"line {number} has more than {MAX_TEXT_CHARS:,} characters")
    return row


def _parsed_row(number: int, line: bytes, jsonl: bool) -> Row:
    try:
        if not jsonl:
            return Row(number, line.decode("utf-8"))
        if not line.strip():
            return Row(number, None, f"line {number} is empty; expected a JSON object")
        value = parse_json(line, what=f"line {number}")
    except UnicodeDecodeError:
        return Row(number, None, f"line {number} is not UTF-8 text")
    except EdgeInferError as exc:
        return Row(number, None, str(exc))
    if not isinstance(value, dict):
        return Row(number, None, f"line {number} is not a JSON object with a 'text' field")
    row_id = value.get("id", number)
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        row_id = number
    text = value.get("text")
    if not isinstance(text, str):
        return Row(row_id, None, f"line {number}: 'text' must be a string")
    return Row(row_id, text)


def _chunks(rows: Iterator[Row]) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == _CHUNK_ROWS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _embed_chunk(model: Any, chunk: list[Row], out: IO[str], args: argparse.Namespace) -> int:
    """Write the chunk's records in order; the number of error records."""
    good = [row for row in chunk if row.error is None]
    result = None
    if good:
        texts = [row.text or "" for row in good]
        result = model.embed_detailed(texts, normalize=args.normalize, batch_size=args.batch_size)
    place = 0
    for row in chunk:
        if row.error is not None:
            record: dict[str, Any] = {"id": row.id, "error": row.error}
        else:
            assert result is not None
            record = {
                "id": row.id,
                "embedding": result.vectors[place].tolist(),
                "tokens": result.tokens[place],
                "truncated": result.truncated[place],
            }
            place += 1
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    return sum(row.error is not None for row in chunk)
