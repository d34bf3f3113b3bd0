"""Messages of a conversation with tools, checked before any template sees them.

An assistant message may carry OpenAI's ``tool_calls``: ``[{"id", "type": "function",
"function": {"name", "arguments": JSON text of an object}}]`` (its ``content`` may then be
None); a ``role: "tool"`` message answers one of them by ``tool_call_id``. Checked here: the
call's shape, its name, its arguments (bounded JSON of an object) and that every tool
message answers a call made earlier and not answered yet. Templates get the arguments as
objects (what Hugging Face templates expect: they write them with ``tojson``) and each tool
message gets the ``name`` of the call it answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..bounded_json import parse_json
from ..errors import InvalidRequestError, short_repr

__all__ = ["ToolTurns", "arguments_object"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as tools/spec.py: OpenAI's function names
MAX_ID_CHARS = 256
MAX_CALLS_PER_MESSAGE = 128


def arguments_object(value: Any, where: str) -> dict[str, Any]:
    """A call's ``arguments`` (JSON text of an object, or the object) as a dict."""
    if isinstance(value, str):
        try:
            value = parse_json(value, what="its text")
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{where}: {exc}") from None
    elif isinstance(value, Mapping):
        value = json.loads(_dumps(value, where))
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where}: must be a JSON object (text), not {_kind(value)}")
    return value


def _dumps(value: Any, where: str) -> str:
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"{where}: is not plain JSON ({exc})") from None


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "a boolean"}.get(type(value), "a value")


class ToolTurns:
    """The tool calls made so far in one conversation, checked message by message."""

    def __init__(self) -> None:
        self.open: dict[str, str] = {}  # id -> function name: calls not answered yet
        self.made: set[str] = set()

    def assistant(self, message: Mapping[str, Any], where: str) -> dict[str, Any]:
        """An assistant message with ``tool_calls``, its calls normalized."""
        calls = message.get("tool_calls")
        if not isinstance(calls, list) or len(calls) > MAX_CALLS_PER_MESSAGE:
            raise InvalidRequestError(
                f"{where}.tool_calls: must be a list of at most {MAX_CALLS_PER_MESSAGE} calls"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise InvalidRequestError(f"{where}.content: must be a string or null")
        checked = dict(message)
        checked["content"] = content or ""
        checked["tool_calls"] = [
            self._call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)
        ]
        return checked

    def _call(self, call: Any, where: str) -> dict[str, Any]:
        if not isinstance(call, Mapping) or call.get("type", "function") != "function":
            raise InvalidRequestError(f'{where}: must be {{"id", "type": "function", "function"}}')
        call_id = call.get("id")
        if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_ID_CHARS:
            raise InvalidRequestError(f"{where}.id: must be a non-empty string (the call's id)")
        if call_id in self.made:
            raise InvalidRequestError(f"{where}.id: {short_repr(call_id, 60)} is used twice")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f'{where}.function: must be {{"name", "arguments"}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.function.name: {short_repr(name, 60)} is not a function name"
            )
        arguments = arguments_object(function.get("arguments", "{}"), f"{where}.function.arguments")
        self.made.add(call_id)
        self.open[call_id] = name
        function = {"name": name, "arguments": arguments}
        return {"id": call_id, "type": "function", "function": function}

    def tool(self, message: Mapping[str, Any], where: str) -> dict[str, Any]:
        """A tool result, with the name of the call it answers."""
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or call_id not in self.open:
            raise InvalidRequestError(
                f"{where}.tool_call_id: {short_repr(call_id, 60)} matches no earlier "
                "assistant tool call left unanswered; give the id of the call this result "
                "answers"
            )
        if not isinstance(message.get("content"), str):
            raise InvalidRequestError(f"{where}.content: must be a string (the tool's result)")
        checked = dict(message)
        checked["name"] = self.open.pop(call_id)
        return checked
