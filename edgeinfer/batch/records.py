"""A batch job's rows and records: input lines checked into requests, and the output lines.

Each input line comes from a stranger's file, so it is bounded before it is parsed (bytes,
then JSON depth and numbers through :func:`edgeinfer.bounded_json.parse_json`) and every field
is checked here, in one place; a line that fails becomes an error record, never an exception.
The output is JSON Lines, one record per input row::

    {"id": ..., "text": ..., "finish_reason": ..., "usage": {"prompt_tokens": ...,
     "completion_tokens": ..., "draft_tokens": ..., "accepted_tokens": ...}, "parsed": ...,
     "error": null | {"type": ..., "message": ...}}

``draft_tokens`` and ``accepted_tokens`` are speculative decoding's (``GenerationStats``): the
tokens drafted for the row, and of those the ones kept; both 0 when it did not draft.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..bounded_json import parse_json
from ..errors import EdgeInferError, InvalidRequestError, short_repr
from ..generation.sampling import SamplingConfig

__all__ = [
    "MAX_ID_CHARS",
    "MAX_LINE_BYTES",
    "Request",
    "Row",
    "bad_row",
    "encode_record",
    "error_record",
    "oversized_row",
    "parse_line",
    "parse_object",
    "result_record",
    "row_key",
]

MAX_LINE_BYTES = 1 << 20  # one request line; longer lines are refused unread
MAX_DEPTH = 32  # JSON nesting of one line (a JSON schema in response_format needs some)
MAX_ID_CHARS = 256
_INT64 = 2**63

# row field -> SamplingConfig field; the OpenAI names and edgeinfer's own both work
_LENGTH_FIELDS = ("max_tokens", "max_new_tokens", "max_completion_tokens")
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
    "logit_bias",
    "response_format",
    "speculative",  # parsed by SamplingConfig as the server parses it; a bad one: the row's error
)
_KNOWN = frozenset(("id", "prompt", "messages", "metadata", *_LENGTH_FIELDS, *_SAMPLING_FIELDS))


@dataclass(frozen=True)
class Request:
    """One checked request: a prompt or chat messages, and its sampling settings."""

    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    config: SamplingConfig


@dataclass(frozen=True)
class Row:
    """One input row: its position (``line``, from 1), its id, and a request or an error."""

    line: int
    id: str | int
    request: Request | None = None
    error: dict[str, str] | None = None

    @property
    def key(self) -> str:
        return row_key(self.id)


def row_key(row_id: str | int) -> str:
    """What makes two ids the same: 7 and "7" name one row (ids often pass through text)."""
    return str(row_id)


class _BadRow(InvalidRequestError):
    """A row the job cannot run; ``row_id`` is its id when it could be read."""

    def __init__(self, message: str, row_id: str | int | None = None) -> None:
        super().__init__(message)
        self.row_id = row_id


def parse_line(raw: bytes, line: int, base: SamplingConfig) -> Row:
    """Row ``line`` (counted from 1) of a JSON Lines file; never raises for bad input."""
    if len(raw) > MAX_LINE_BYTES:
        return oversized_row(line)
    try:
        value = parse_json(raw, what=f"line {line}", max_depth=MAX_DEPTH)
    except EdgeInferError as exc:
        return _error_row(line, None, str(exc))
    return parse_object(value, line, base)


def oversized_row(line: int) -> Row:
    return bad_row(line, f"line {line} is longer than {MAX_LINE_BYTES:,} bytes")


def bad_row(line: int, message: str, row_id: str | int | None = None) -> Row:
    """An error row for a line that could not be read; its id is ``row_id`` when that could
    be read, else its line number."""
    return _error_row(line, row_id, message)


def parse_object(value: Any, line: int, base: SamplingConfig) -> Row:
    """Row ``line`` from an already decoded value (a JSON line, a CSV row)."""
    row_id: str | int = line
    try:
        if not isinstance(value, dict):
            raise _BadRow(f"line {line} is {_kind(value)}, not a JSON object")
        row_id = _row_id(value, line)
        return Row(line, row_id, request=_request(value, base))
    except _BadRow as exc:
        return _error_row(line, exc.row_id if exc.row_id is not None else row_id, str(exc))
    except EdgeInferError as exc:  # a field SamplingConfig refused
        return _error_row(line, row_id, str(exc), type(exc).__name__)


def _error_row(
    line: int, row_id: str | int | None, message: str, kind: str = "InvalidRequestError"
) -> Row:
    return Row(line, line if row_id is None else row_id, error={"type": kind, "message": message})


def _kind(value: Any) -> str:
    names = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _row_id(obj: dict[str, Any], line: int) -> str | int:
    row_id = obj.get("id")
    if row_id is None:
        return line
    if isinstance(row_id, str) and 0 < len(row_id) <= MAX_ID_CHARS:
        return row_id
    if isinstance(row_id, int) and not isinstance(row_id, bool) and -_INT64 <= row_id < _INT64:
        return row_id
    raise _BadRow(
        f"id {short_repr(row_id, 40)} is invalid: expected a string of 1 to {MAX_ID_CHARS} "
        "characters or an integer (or no id: the line number is used)"
    )


def _request(obj: dict[str, Any], base: SamplingConfig) -> Request:
    unknown = sorted(k for k in obj if k not in _KNOWN)
    if unknown:
        raise _BadRow(
            f"unknown field {short_repr(unknown[0], 40)}; known: {', '.join(sorted(_KNOWN))} "
            "(put your own data under metadata)"
        )
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise _BadRow("a row needs a prompt (text) or messages (a chat), and not both")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise _BadRow("prompt must be non-empty text")
    chat = None if messages is None else _messages(messages)
    return Request(prompt, chat, SamplingConfig.from_kwargs(base, **_sampling(obj)))


def _sampling(obj: dict[str, Any]) -> dict[str, Any]:
    given = [k for k in _LENGTH_FIELDS if k in obj]
    if len(given) > 1:
        raise _BadRow(f"{' and '.join(given)} say the same thing; give one")
    kwargs = {"max_new_tokens": obj[given[0]]} if given else {}
    for name in _SAMPLING_FIELDS:
        if name in obj and obj[name] is not None:
            kwargs[name] = obj[name]
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = _logit_bias(kwargs["logit_bias"])
    if isinstance(kwargs.get("stop"), list):
        kwargs["stop"] = tuple(kwargs["stop"])
    return kwargs


def _logit_bias(value: Any) -> Any:
    """JSON object keys are text: ``{"50256": -100}`` as token 50256; -100 or less bans it
    (OpenAI's convention). Anything else is left to SamplingConfig to refuse."""
    if not isinstance(value, Mapping):
        return value
    out: dict[Any, Any] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19):
            raise _BadRow(f"logit_bias key {short_repr(key, 30)} is not a token id (digits)")
        numeric = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        out[int(key)] = -math.inf if numeric and bias <= -100 else bias
    return out


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _BadRow("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _BadRow(f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise _BadRow(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _BadRow(f"messages[{i}].content must be text or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


# -- output records -------------------------------------------------------------------------


def result_record(row_id: str | int, result: Any) -> dict[str, Any]:
    """The record of a finished request (a GenerationResult)."""
    return {
        "id": row_id,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "usage": {
            "prompt_tokens": result.stats.prompt_tokens,
            "completion_tokens": result.stats.completion_tokens,
            "draft_tokens": result.stats.draft_tokens,
            "accepted_tokens": result.stats.accepted_tokens,
        },
        "parsed": result.parsed,
        "error": None,
    }


def error_record(row_id: str | int, kind: str, message: str) -> dict[str, Any]:
    return {
        "id": row_id,
        "text": None,
        "finish_reason": None,
        "usage": None,
        "parsed": None,
        "error": {"type": kind, "message": message},
    }


def encode_record(record: Mapping[str, Any]) -> bytes:
    """One output line. Text is kept as UTF-8, not escaped; a lone surrogate (which a model's
    bytes cannot make, but a stranger's id could not carry either) cannot reach here."""
    return json.dumps(record, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n"
