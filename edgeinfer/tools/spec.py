"""``tools`` and ``tool_choice`` in OpenAI's shapes, checked where they enter.

A tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``;
``parameters`` is a JSON schema of an object (absent: a function without arguments).
``tool_choice`` is ``"auto"``, ``"none"``, ``"required"`` or
``{"type": "function", "function": {"name": ...}}``. Every refusal is an
``InvalidRequestError`` whose message starts with the field it is about (``tools[2].function
.name: ...``), so the server can answer 400 naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError, short_repr
from ..generation.structured_bounds import check_schema
from .schema import check_parameters

__all__ = [
    "MAX_TOOLS",
    "MAX_TOOLS_BYTES",
    "Tool",
    "ToolChoice",
    "check_tool_choice",
    "check_tools",
]

MAX_TOOLS = 128  # OpenAI's own limit on one request's tools
MAX_TOOLS_BYTES = 512 * 1024  # all tools as JSON text
MAX_DESCRIPTION_CHARS = 8 * 1024
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tool:
    """One checked function: its name, description and the JSON schema of its arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's shape (what chat templates expect in ``tools``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: auto, none or required; ``name``: the one function a named choice forces."""

    mode: str
    name: str | None = None

    @property
    def constrained(self) -> bool:
        """Generation must produce a call (required, or a named function)."""
        return self.mode == "required"


def refuse(field: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {why}")


def check_tools(value: Any) -> tuple[Tool, ...]:
    """``tools`` as checked Tools: a list of OpenAI function tools with unique names and
    valid, bounded parameter schemas."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise refuse("tools", f"must be a list of tools, not {type(value).__name__}")
    if len(value) > MAX_TOOLS:
        raise refuse("tools", f"has {len(value)} tools; at most {MAX_TOOLS} are allowed")
    _check_size(value)
    tools = [_tool(item, f"tools[{i}]") for i, item in enumerate(value)]
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise refuse(
                f"tools[{i}].function.name",
                f"{tool.name!r} is also the name of tools[{seen[tool.name]}]; names must be unique",
            )
        seen[tool.name] = i
    return tuple(tools)


def _check_size(value: Sequence[Any]) -> None:
    try:
        size = len(json.dumps(list(value), ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise refuse(
            "tools", f"must be plain JSON (objects, lists, strings, numbers): {exc}"
        ) from None
    if size > MAX_TOOLS_BYTES:
        raise refuse("tools", f"is {size:,} characters as JSON; at most {MAX_TOOLS_BYTES:,}")


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, Mapping):
        raise refuse(where, f"must be an object, not {type(item).__name__}")
    if item.get("type", "function") != "function":
        raise refuse(f"{where}.type", f"{short_repr(item.get('type'), 40)}; only 'function'")
    function = item.get("function")
    if not isinstance(function, Mapping):
        raise refuse(f"{where}.function", 'must be an object {"name": ..., "parameters": ...}')
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise refuse(
            f"{where}.function.name",
            f"{short_repr(name, 60)} is not a function name (1-64 of A-Z a-z 0-9 _ -)",
        )
    description = function.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        raise refuse(
            f"{where}.function.description",
            f"must be a string of at most {MAX_DESCRIPTION_CHARS:,} characters",
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_OBJECT
    field = f"{where}.function.parameters"
    if not isinstance(parameters, Mapping):
        raise refuse(field, "must be a JSON schema object")
    try:
        check_schema(parameters, field)
    except InvalidRequestError as exc:
        raise refuse(field, str(exc).replace("response_format ", "")) from None
    check_parameters(parameters, field)
    return Tool(name, description, json.loads(json.dumps(parameters)))


def check_tool_choice(value: Any, tools: Sequence[Tool]) -> ToolChoice:
    """``tool_choice`` checked against ``tools``; None means auto with tools, none without."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in _CHOICES:
            raise refuse(
                "tool_choice",
                f"{short_repr(value, 40)}; expected one of {', '.join(_CHOICES)} or "
                '{"type": "function", "function": {"name": ...}}',
            )
        if value == "required" and not tools:
            raise refuse("tool_choice", "'required' needs tools; none were given")
        return ToolChoice(value if tools else "none")  # "auto" without tools: no tools
    name = None
    if isinstance(value, Mapping) and value.get("type", "function") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise refuse(
            "tool_choice",
            'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
        )
    if name not in {t.name for t in tools}:
        raise refuse("tool_choice.function.name", f"{short_repr(name, 60)} is not among tools")
    return ToolChoice("required", name)


def check_parallel(value: Any) -> bool:
    """``parallel_tool_calls``: may one reply hold several calls (None: True, as OpenAI)."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise refuse("parallel_tool_calls", "must be true or false")
    return value
