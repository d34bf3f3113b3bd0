"""``POST /v1/responses`` bodies: OpenAI's Responses request read as a chat request.

The request becomes the chat-completion request the server already runs (``wire.parse_chat``,
then ``Model.chat`` with its tools and structured output); nothing here generates.

- ``instructions`` (a string): a system message first; not carried over by
  ``previous_response_id`` (as OpenAI's);
- ``previous_response_id``: the kept conversation of that response (``response_store``);
- ``input``: a string (one user message) or items: messages (``role`` user, assistant, system
  or developer — read as system — with a string or text parts), ``function_call`` items (an
  assistant turn calling tools) and ``function_call_output`` items (a tool's result);
- ``tools``: function tools (``{"type": "function", "name", "parameters"}``), with
  ``tool_choice`` ("auto", "none", "required", ``{"type": "function", "name"}``) and
  ``parallel_tool_calls``;
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``), and
  edgeinfer's other response_format kinds as they are;
- ``max_output_tokens``, ``temperature``, ``top_p``; edgeinfer's ``seed``, ``logit_bias`` and
  ``speculative`` (read and checked as chat completions read them: a bad value is a 400 naming
  ``speculative``).

Fields that would change what OpenAI returns and that edgeinfer does not do (``background``,
``conversation``, ``prompt``, ``truncation: "auto"``, ``top_logprobs``, ``max_tool_calls``,
a ``reasoning`` effort) are refused; others (``metadata``, ``user``, ``include``,
``service_tier``, ...) are accepted and echoed or ignored. A refusal is a 400 naming the
Responses field (``input[2].call_id``, ``text.format``, ``max_output_tokens``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from . import wire
from .response_items import ItemReader, Origins
from .response_store import ResponseStore

__all__ = ["ResponseRequest", "parse_response"]

# refused unless they hold their "off" value
_REFUSED: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}
# carried into the chat request as they are, and checked there as chat completions check them
_SAMPLING = ("temperature", "top_p", "seed", "logit_bias", "speculative")
_MAX_METADATA = 16


@dataclass
class ResponseRequest:
    """A checked request: the chat request it runs as, and what its response echoes."""

    chat: wire.ChatRequest
    conversation: list[dict[str, Any]]  # the messages to keep (without the instructions)
    store: bool
    echo: dict[str, Any] = field(default_factory=dict)


def parse_response(body: Any, store: ResponseStore, defaults: str = "edgeinfer") -> ResponseRequest:
    """``body`` as a chat request; WireError (400 naming the field) otherwise."""
    if not isinstance(body, dict):
        raise wire.WireError(400, "the request body must be a JSON object", code="invalid_json")
    _refuse_unsupported(body)
    instructions = _optional_str(body, "instructions")
    keep = _flag(body, "store", True)
    earlier, previous = _previous(body, store)
    reader = ItemReader()
    if instructions:
        reader.add_message({"role": "system", "content": instructions}, "instructions")
    reader.add_stored(earlier, "previous_response_id")
    reader.add_input(body.get("input"), has_previous=bool(earlier))
    chat_body = {
        "model": body.get("model"),
        "messages": reader.messages,
        "stream": body.get("stream", False),
        **{k: body[k] for k in _SAMPLING if k in body},
        **_tools(body),
    }
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat_body["response_format"] = text_format
    try:
        chat = wire.parse_chat(chat_body, defaults)
    except wire.WireError as exc:
        raise _renamed(exc, reader.origins) from None
    start = 1 if instructions else 0
    echo = _echo(body, instructions, previous, keep)
    return ResponseRequest(chat, chat.messages[start:], keep, echo)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, allowed in _REFUSED.items():
        if key in body and body[key] not in allowed:
            raise wire.WireError(
                400,
                f"{key}={wire.shown(body[key])} is not supported by this server (edgeinfer); "
                "leave it out",
                param=key,
                code="unsupported_parameter",
            )
    reasoning = body.get("reasoning")
    if reasoning is not None:
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else reasoning
        if effort not in (None, "none", "minimal"):
            raise wire.WireError(
                400,
                "reasoning: this server's models do not reason before answering; leave "
                "reasoning out (or set its effort to null)",
                param="reasoning.effort",
                code="unsupported_parameter",
            )
    for key in ("user", "service_tier", "prompt_cache_key", "safety_identifier"):
        _optional_str(body, key)
    include = body.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(i, str) for i in include)
    ):
        raise wire.bad("include", "must be a list of strings")
    _metadata(body.get("metadata"))


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise wire.bad(key, "must be a string")
    return value


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wire.bad(key, "must be true or false")
    return value


def _metadata(value: Any) -> None:
    if value is None:
        return
    if (
        not isinstance(value, dict)
        or len(value) > _MAX_METADATA
        or not all(isinstance(k, str) and len(k) <= 64 for k in value)
        or not all(isinstance(v, str) and len(v) <= 512 for v in value.values())
    ):
        raise wire.bad(
            "metadata",
            f"must be an object of at most {_MAX_METADATA} string values (keys of at most 64 "
            "characters, values of at most 512)",
        )


def _previous(body: dict[str, Any], store: ResponseStore) -> tuple[list[dict[str, Any]], Any]:
    """The kept conversation ``previous_response_id`` names (empty without one)."""
    rid = _optional_str(body, "previous_response_id")
    if rid is None:
        return [], None
    kept = store.get(rid)
    if kept is None:
        raise wire.WireError(
            400,
            f"previous_response_id: no response {wire.shown(rid)} is kept here; "
            f"{store.terms}. Send the whole conversation in input instead",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return [dict(m) for m in kept.messages], rid


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in chat's shapes (checked by ``wire.parse_chat``)."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise wire.bad("tools", "must be a list of function tools")
        out["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise wire.bad(
                "tool_choice",
                'must be "auto", "none", "required" or {"type": "function", "name": ...} '
                "(this server runs function tools only)",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise wire.bad(f"tools[{i}]", "must be an object")
    if tool.get("type") != "function":
        raise wire.bad(
            f"tools[{i}].type",
            f"{wire.shown(tool.get('type'))}: this server runs function tools only "
            '({"type": "function", "name", "parameters"})',
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as a response_format (checked by ``SamplingConfig``)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise wire.bad("text", 'must be an object like {"format": {"type": "text"}}')
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise wire.bad("text.format", "must be an object with a type (text, json_schema, ...)")
    if fmt["type"] != "json_schema":
        return dict(fmt)
    if not isinstance(fmt.get("schema"), dict):
        raise wire.bad("text.format", 'json_schema needs "schema": a JSON schema object')
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    rest = {k: v for k, v in fmt.items() if k not in spec and k != "type"}
    return {"type": "json_schema", "json_schema": spec, **rest}


def _echo(
    body: dict[str, Any], instructions: str | None, previous: str | None, keep: bool
) -> dict[str, Any]:
    """The request's fields as its response object repeats them."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": previous,
        "store": keep,
        "text": {"format": (text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
        "tools": body.get("tools") or [],
        "user": body.get("user"),
    }


# -- refusals named as the Responses request names its fields ---------------------------------

_MESSAGE = re.compile(r"^messages\[(\d+)\](.*)$")
_FIELDS = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tool_choice.function.name": "tool_choice.name",
}
_TOOL = re.compile(r"^tools\[(\d+)\]\.function(.*)$")


def _renamed(exc: wire.WireError, origins: Origins) -> wire.WireError:
    """``exc`` (about the chat request) naming the Responses field it came from."""
    param = exc.param
    if param is None:
        return exc
    new = _FIELDS.get(param)
    if new is None and (m := _TOOL.match(param)):
        new = f"tools[{m.group(1)}]{m.group(2)}"
    if new is None and (m := _MESSAGE.match(param)):
        new = origins.name(int(m.group(1)), m.group(2))
    if new is None:
        return exc
    message = exc.message.replace(param, new, 1)
    return wire.WireError(exc.status, message, param=new, code=exc.code, kind=exc.kind)
