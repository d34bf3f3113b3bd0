"""A Responses request's ``input`` items read as chat messages, each remembered by the field
it came from (``Origins``), so that a refusal of the chat request can name the item.

Items: a message (``{"role", "content"}``, ``type`` "message" or left out) whose content is a
string or a list of text parts (``input_text``, ``output_text``, ``text``, ``refusal``);
a ``function_call`` (``call_id``, ``name``, ``arguments``): consecutive calls make one
assistant turn; a ``function_call_output`` (``call_id``, ``output``: a string or text parts):
a tool message answering that call. Images, files, audio and the other item types are
refused (400 naming the item): the served models read text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import wire

__all__ = ["MAX_ITEMS", "ItemReader", "Origins"]

MAX_ITEMS = 4096  # input items of one request
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# a chat message's field -> the item's field, for a tool message and for a call
_TOOL_FIELDS = {".tool_call_id": ".call_id", ".content": ".output"}
_CALL_FIELDS = {".id": ".call_id", ".function.name": ".name", ".function.arguments": ".arguments"}


@dataclass
class Origins:
    """Where each chat message came from: ``names[i]`` for message i, and for an assistant
    turn made of calls, ``calls[i][k]`` for its k-th call."""

    names: list[str] = field(default_factory=list)
    tool: list[bool] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)

    def name(self, i: int, rest: str) -> str | None:
        """The Responses field of chat field ``messages[i]`` + ``rest``."""
        if not 0 <= i < len(self.names):
            return None
        calls = self.calls.get(i)
        if calls and rest.startswith(".tool_calls["):
            index, _, after = rest[len(".tool_calls[") :].partition("]")
            if index.isdigit() and int(index) < len(calls):
                return calls[int(index)] + _CALL_FIELDS.get(after, after)
            return calls[0]
        if calls:
            return calls[0]
        if self.tool[i]:
            return self.names[i] + _TOOL_FIELDS.get(rest, rest)
        return self.names[i] + rest


class ItemReader:
    """Builds the chat messages of a request, item by item."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins = Origins()

    def add_message(self, message: dict[str, Any], origin: str, tool: bool = False) -> None:
        self.messages.append(message)
        self.origins.names.append(origin)
        self.origins.tool.append(tool)

    def add_stored(self, messages: list[dict[str, Any]], origin: str) -> None:
        for message in messages:
            self.add_message(message, origin)

    def add_input(self, value: Any, has_previous: bool) -> None:
        if isinstance(value, str):
            if not value and not has_previous:
                raise wire.bad("input", "is empty: give text or a list of input items")
            if value:
                self.add_message({"role": "user", "content": value}, "input")
            return
        if value is None and has_previous:
            return
        if not isinstance(value, list) or (not value and not has_previous):
            raise wire.bad("input", "must be a string or a non-empty list of input items")
        if len(value) > MAX_ITEMS:
            raise wire.bad("input", f"has {len(value)} items, more than {MAX_ITEMS}")
        for i, item in enumerate(value):
            self._item(item, f"input[{i}]")

    def _item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise wire.bad(where, "must be an object (a message or a function_call item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output", "output")
            message = {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            self.add_message(message, where, tool=True)
        else:
            raise wire.bad(
                f"{where}.type",
                f"{wire.shown(kind)}: this server reads message, function_call and "
                "function_call_output items",
            )

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in _ROLES:
            raise wire.bad(f"{where}.role", f"{wire.shown(role)}; expected one of {_ROLES}")
        content = _text(item.get("content"), f"{where}.content", "content")
        self.add_message({"role": wire.chat_role(role), "content": content}, where)

    def _call(self, item: dict[str, Any], where: str) -> None:
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        last = len(self.messages) - 1
        if last in self.origins.calls:  # the turn the previous call item began
            self.messages[last]["tool_calls"].append(call)
            self.origins.calls[last].append(where)
            return
        self.add_message({"role": "assistant", "content": None, "tool_calls": [call]}, where)
        self.origins.calls[last + 1] = [where]


def _text(value: Any, where: str, what: str) -> str:
    """A string, or text parts joined; anything else is a 400 naming ``where``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wire.bad(where, f"{what} must be a string or a list of text parts")
    pieces = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise wire.bad(
                f"{where}[{k}]",
                f"{wire.shown(kind)}: only text parts (input_text, output_text) are read by "
                "this server; its models read text",
            )
        text = part.get(key)
        if not isinstance(text, str):
            raise wire.bad(f"{where}[{k}].{key}", f"a {kind} part needs a string {key}")
        pieces.append(text)
    return "".join(pieces)
