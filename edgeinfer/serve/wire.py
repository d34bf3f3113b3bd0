"""OpenAI's wire format: request bodies checked and turned into generator calls, and the
response objects built from edgeinfer's chunks and stats.

Every refusal is a ``WireError`` with the HTTP status, OpenAI's error type and code, and the
field it is about, so a client sees ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..chat import validate_messages
from ..errors import InvalidRequestError
from ..generation.results import GenerationStats
from ..tools.spec import check_parallel, check_tool_choice, check_tools
from . import logprobs

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "WireError",
    "chat_role",
    "check_model",
    "parse_chat",
    "parse_completion",
    "unknown_model",
]

# Fields that change what OpenAI would return and that edgeinfer does not do: refused unless
# they hold their "off" value. Other unknown fields (user, metadata, store, ...) are ignored.
_REFUSED = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
_MAX_STOPS = 4
# What a request that leaves the sampling fields out gets (``edgeinfer serve
# --sampling-defaults``): edgeinfer's own (SamplingConfig's: temperature 0.8, top_k 40, top_p
# 0.95), or OpenAI's (temperature 1, top_p 1, no top-k).
SAMPLING_DEFAULTS: dict[str, dict[str, Any]] = {
    "edgeinfer": {},
    "openai": {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
}
_INT64_MAX = 2**63 - 1  # what OpenAI's integer fields hold; beyond it no engine can take it


class WireError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, why: str) -> WireError:
    return WireError(400, f"{param}: {why}", param=param, code="invalid_value")


@dataclass
class _Common:
    model: str | None
    stream: bool
    include_usage: bool
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChatRequest(_Common):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: dict[str, Any] = field(default_factory=dict)  # tools, tool_choice, parallel_...


@dataclass
class CompletionRequest(_Common):
    prompt: str = ""


def parse_chat(body: Any, defaults: str = "edgeinfer") -> ChatRequest:
    """A chat request; ``defaults`` names the sampling a field left out takes
    (SAMPLING_DEFAULTS)."""
    common = _common(body, ("max_completion_tokens", "max_tokens"), defaults, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    checked = [_message(m, i) for i, m in enumerate(messages)]
    _checked(validate_messages, checked)  # tool calls and the results that answer them
    return ChatRequest(**common, messages=checked, tools=_tools(body))


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as ``Model.chat`` takes them
    (checked here too, so that a refusal names its field)."""
    fields = {k: body.get(k) for k in ("tools", "tool_choice", "parallel_tool_calls")}
    if all(v is None for v in fields.values()):
        return {}
    tools = _checked(check_tools, fields["tools"])
    _checked(check_tool_choice, fields["tool_choice"], tools)
    _checked(check_parallel, fields["parallel_tool_calls"])
    return fields


def _checked(check: Any, *args: Any) -> Any:
    """``check(*args)``; its InvalidRequestError ("field: why") as a 400 naming the field."""
    try:
        return check(*args)
    except InvalidRequestError as exc:
        text = str(exc)
        param = text.split(":", 1)[0] if ": " in text else None
        raise WireError(400, text, param=param, code="invalid_value") from None


def parse_completion(body: Any, defaults: str = "edgeinfer") -> CompletionRequest:
    common = _common(body, ("max_tokens",), defaults, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "must be a non-empty string (one prompt per request)")
    return CompletionRequest(**common, prompt=prompt)


def _common(body: Any, length_keys: tuple[str, ...], defaults: str, kind: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object", code="invalid_json")
    for key, allowed in _REFUSED.items():
        if key in body and body[key] not in allowed:
            raise WireError(
                400,
                f"{key} is not supported by this server (edgeinfer); leave it out",
                param=key,
                code="unsupported_parameter",
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    if body.get("n", 1) is not None and _integer(body, "n", 1, default=1) != 1:
        raise WireError(
            400,
            "n: only n=1 is supported (one choice per request)",
            param="n",
            code="invalid_value",
        )
    stream, include_usage = _streaming(body)
    sampling = _sampling(body, length_keys, SAMPLING_DEFAULTS[defaults])
    top = logprobs.requested(body, kind, bad)
    if top is not None:
        sampling["top_logprobs"] = top
    return {"model": model, "stream": stream, "include_usage": include_usage, "sampling": sampling}


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or not isinstance(
            options.get("include_usage", False), bool
        ):
            raise bad("stream_options", 'must be an object like {"include_usage": true}')
        if not stream:
            raise bad("stream_options", "is only allowed with stream=true")
        include_usage = bool(options.get("include_usage", False))
    return stream, include_usage


def _sampling(
    body: dict[str, Any], length_keys: tuple[str, ...], defaults: dict[str, Any]
) -> dict[str, Any]:
    """The sampling settings as ``Model.chat``/``Model.stream`` take them."""
    sampling: dict[str, Any] = dict(defaults)
    for key in length_keys:
        if body.get(key) is not None:
            sampling["max_new_tokens"] = _integer(body, key, 1)
            break
    if body.get("temperature") is not None:
        sampling["temperature"] = _number(body, "temperature", 0.0, 2.0)
    if body.get("top_p") is not None:
        sampling["top_p"] = _number(body, "top_p", 0.0, 1.0)
        if sampling["top_p"] == 0.0:
            raise bad("top_p", "must be greater than 0")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) is not None:
            sampling[key] = _number(body, key, -2.0, 2.0)
    if body.get("seed") is not None:
        sampling["seed"] = _integer(body, "seed", 0)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list)
            or len(stops) > _MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)
        ):
            raise bad("stop", f"must be a non-empty string or a list of at most {_MAX_STOPS}")
        sampling["stop"] = tuple(stops)
    if body.get("logit_bias") is not None:
        sampling["logit_bias"] = _logit_bias(body["logit_bias"])
    if body.get("response_format") is not None:  # checked by SamplingConfig (400 if bad)
        sampling["response_format"] = body["response_format"]
    if body.get("speculative") is not None:  # edgeinfer's field: checked by SamplingConfig
        sampling["speculative"] = body["speculative"]
    return sampling


def _integer(body: dict[str, Any], key: str, low: int, *, default: int | None = None) -> int:
    """An integer field within [low, int64's largest]: beyond that no engine can hold it."""
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _INT64_MAX:
        raise bad(key, f"must be an integer from {low} to {_INT64_MAX}")
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"must be a number from {low} to {high}")
    if not (math.isfinite(value) and low <= value <= high):
        raise bad(key, f"must be a number from {low} to {high}")
    return float(value)


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]}; -100 bans the token."""
    if not isinstance(value, dict):
        raise bad("logit_bias", 'must be an object like {"50256": -100}')
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad(
                "logit_bias", f"the bias of token {shown(key)} must be a number from -100 to 100"
            )
        out[token] = float("-inf") if bias <= -100 else float(bias)
    return out


def _token_id(key: Any) -> int:
    """A logit_bias key: a token id written in ASCII digits (``int()`` would also take
    spaces, underscores, signs and other scripts' digits), within int64."""
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19):
        raise bad("logit_bias", f"key {shown(key)} is not a token id (decimal digits)")
    token = int(key)
    if token > _INT64_MAX:
        raise bad("logit_bias", f"key {shown(key)} is beyond the largest token id")
    return token


def shown(value: Any, limit: int = 40) -> str:
    """A stranger's value for a message: quoted, escaped, and cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def chat_role(role: str) -> str:
    """A message's role as the chat templates take it: OpenAI's ``developer`` (the newer name
    of the system role) is read as ``system``, since the templates edgeinfer renders know
    system, user, assistant and tool only."""
    return "system" if role == "developer" else role


def unknown_model(name: str, requested: str) -> WireError:
    """The 404 of every endpoint for a model name this server does not serve."""
    return WireError(
        404,
        f"model {shown(requested)} is not served here; this server serves {name!r} "
        "(start it with --any-model-name to answer every model name with it)",
        param="model",
        code="model_not_found",
    )


def check_model(name: str, requested: str | None, any_name: bool) -> None:
    """``requested`` (a body's ``model``) names the served model: its name, "default", or
    any name when the server was started with ``--any-model-name``."""
    if requested is not None and not any_name and requested not in (name, "default"):
        raise unknown_model(name, requested)


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad(where, "must be an object with a string role")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}.content", "only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.content", "a text part needs a string text")
            parts.append(part["text"])
        content = "".join(parts)
    message: dict[str, Any] = {"role": chat_role(m["role"]), "content": content}
    if m["role"] == "assistant" and m.get("tool_calls") is not None:
        message["tool_calls"] = m["tool_calls"]  # checked by validate_messages
        if content is None:
            return message
    if m["role"] == "tool":
        message["tool_call_id"] = m.get("tool_call_id")
    if not isinstance(content, str):
        raise bad(f"{where}.content", "must be a string or a list of text parts")
    return message


# -- responses ----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(stats: GenerationStats | None) -> dict[str, Any]:
    if stats is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_prompt_tokens},
    }


def finish(reason: str | None) -> str | None:
    """edgeinfer's finish reasons as OpenAI's: stop and length; and "cancelled" for a reply
    the server cut short because it is shutting down (a client that left reads nothing), so
    that a cut reply is never taken for a complete one. OpenAI's clients accept the value."""
    if reason is None:
        return None
    return reason if reason in ("length", "cancelled", "tool_calls") else "stop"


def chat_chunk(
    rid: str, model: str, created: int, delta: dict[str, Any], reason: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish(reason)}],
    }


def completion_chunk(
    rid: str, model: str, created: int, text: str, reason: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish(reason)}],
    }


def now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class Shape:
    """How one request's replies look: a chat or a text completion, with its id."""

    kind: str  # "chat" | "completion"
    rid: str
    model: str
    created: int
    include_usage: bool = False
    # the model's token -> UTF-8 bytes, for logprobs (None: the request asked for none)
    token_bytes: logprobs.TokenText | None = None
    # the request's own names of edgeinfer's settings where they differ (replies.invalid)
    param_names: ClassVar[dict[str, str] | None] = None

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt: what a prompt too long for the context names."""
        return "messages" if self.kind == "chat" else "prompt"

    def whole(
        self,
        text: str,
        reason: str | None,
        stats: GenerationStats,
        tool_calls: tuple[dict[str, Any], ...] = (),
        token_logprobs: tuple[Any, ...] = (),
    ) -> dict[str, Any]:
        """The non-streamed reply."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish(reason)}
        choice["logprobs"] = self.logprobs(token_logprobs)
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"] = {
                    "role": "assistant",
                    "content": text or None,
                    "tool_calls": list(tool_calls),
                }
        else:
            choice["text"] = text
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(stats),
        }

    def opening(self) -> dict[str, Any] | None:
        """The stream's first chunk (a chat's role), or None."""
        if self.kind != "chat":
            return None
        return chat_chunk(
            self.rid, self.model, self.created, {"role": "assistant", "content": ""}, None
        )

    def chunk(
        self, text: str, reason: str | None, calls: tuple[dict[str, Any], ...] = (), first: int = 0
    ) -> dict[str, Any]:
        """A streamed piece: text, and the calls completed with it (numbered from
        ``first``, the calls sent before in this stream), each whole in one delta."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [{"index": first + i, **c} for i, c in enumerate(calls)]
            return chat_chunk(self.rid, self.model, self.created, delta, reason)
        return completion_chunk(self.rid, self.model, self.created, text, reason)

    def logprobs(self, items: tuple[Any, ...], offset: int = 0) -> dict[str, Any] | None:
        """``choices[0].logprobs`` for ``items`` (TokenLogprob), or None when not asked."""
        if self.token_bytes is None:
            return None
        if self.kind == "chat":
            return logprobs.chat_logprobs(items, self.token_bytes)
        return logprobs.completion_logprobs(items, self.token_bytes, offset)

    def usage_tail(self, stats: GenerationStats | None) -> dict[str, Any]:
        return self.chunk("", None) | {"choices": [], "usage": usage(stats)}
