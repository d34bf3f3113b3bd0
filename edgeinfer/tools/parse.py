"""Calls found in a reply: located in the format's syntax, parsed, and checked against the
functions offered.

A call passes when its JSON parses (bounded), names an offered function and its arguments
are an object that satisfies the function's ``parameters`` (schema.violation). A call that
fails any of these is reported as a ``ToolCallError`` with the reason, never handed out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..bounded_json import parse_json
from ..errors import InvalidRequestError
from .formats import CallFormat
from .schema import violation
from .spec import Tool

__all__ = ["ToolCallError", "check_call", "split_reply"]

_PYTHON_TAG = "<|python_tag|>"


class ToolCallError(Exception):
    """A call in the reply that cannot be handed out (internal: becomes tool_call_error)."""


@dataclass(frozen=True)
class Piece:
    """A part of a reply: text, or the raw text of one call (``call``: True)."""

    text: str
    call: bool


def split_reply(text: str, fmt: CallFormat) -> list[Piece]:
    """``text`` cut into plain text and call texts, in order."""
    if fmt.name in ("hermes", "generic"):
        return _tagged(text, fmt)
    stripped = text.strip()
    if fmt.name == "llama3":
        body = stripped.removeprefix(_PYTHON_TAG).strip()
        if body.startswith("{"):
            return [Piece(part, True) for part in _split_llama(body)]
        return [Piece(text, False)]
    if stripped.startswith(fmt.open) or stripped.startswith('[{"'):
        return [Piece(stripped.removeprefix(fmt.open).strip(), True)]
    return [Piece(text, False)]


def _tagged(text: str, fmt: CallFormat) -> list[Piece]:
    opener, closer = "<tool_call>", "</tool_call>"
    pieces: list[Piece] = []
    pos = 0
    while True:
        start = text.find(opener, pos)
        if start < 0:
            break
        if start > pos:
            pieces.append(Piece(text[pos:start], False))
        end = text.find(closer, start)
        stop = len(text) if end < 0 else end + len(closer)
        pieces.append(Piece(text[start:stop], True))
        pos = stop
    if pos < len(text):
        pieces.append(Piece(text[pos:], False))
    return pieces


def _split_llama(body: str) -> list[str]:
    """Several calls are separated by ``;`` (or new lines) between whole objects."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, c in enumerate(body):
        if quoted:
            escaped, quoted = (not escaped and c == "\\"), quoted and (escaped or c != '"')
            continue
        if c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif depth == 0 and c in ";\n":
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


def call_bodies(raw: str, fmt: CallFormat) -> list[Any]:
    """The JSON object(s) of one call's raw text (a list for Mistral's block)."""
    body = raw
    if fmt.name in ("hermes", "generic"):
        if not raw.endswith("</tool_call>"):
            raise ToolCallError("a <tool_call> is not closed with </tool_call>")
        body = raw[len("<tool_call>") : -len("</tool_call>")]
    try:
        value = parse_json(body.strip(), what="the call")
    except InvalidRequestError as exc:
        raise ToolCallError(str(exc)) from None
    if fmt.name == "mistral":
        if not isinstance(value, list) or not value:
            raise ToolCallError("[TOOL_CALLS] is not followed by a list of calls")
        return value
    return [value]


def check_call(body: Any, tools: Sequence[Tool], fmt: CallFormat) -> dict[str, Any]:
    """One call in OpenAI's shape (a new id; arguments as compact JSON text), or
    ToolCallError saying why it is not a valid call to one of ``tools``."""
    if not isinstance(body, Mapping) or not isinstance(body.get("name"), str):
        raise ToolCallError('a call must be a JSON object {"name": ..., "arguments": {...}}')
    name = body["name"]
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        raise ToolCallError(f"the call names {name[:64]!r}, which is not among the tools")
    arguments = body.get(fmt.arguments_key, body.get("arguments", body.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = parse_json(arguments, what="the arguments")
        except InvalidRequestError as exc:
            raise ToolCallError(f"{name}: {exc}") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{name}: the arguments are not a JSON object")
    try:
        wrong = violation(arguments, tool.parameters)
    except RecursionError:
        wrong = "the arguments are nested too deeply to check"
    if wrong is not None:
        raise ToolCallError(f"{name}: the arguments do not match its parameters: {wrong}")
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return {"id": fmt.new_id(), "type": "function", "function": {"name": name, "arguments": text}}


def calls_of(raw: str, tools: Sequence[Tool], fmt: CallFormat) -> list[dict[str, Any]]:
    """Every call in one raw call text, checked; ToolCallError on the first that fails."""
    return [check_call(body, tools, fmt) for body in call_bodies(raw, fmt)]


_OPENERS = {"hermes": "<tool_call>", "generic": "<tool_call>"}


def opener(fmt: CallFormat) -> str | None:
    """The text a call starts with anywhere in a reply (None: only at its start)."""
    return _OPENERS.get(fmt.name)
