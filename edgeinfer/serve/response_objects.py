"""The objects ``/v1/responses`` answers with, in OpenAI's shapes: the response
(``{"object": "response", "status", "output": [items], "usage", ...}``), its output items (an
assistant ``message`` with ``output_text``; a ``function_call`` per tool call) and its usage
(``input_tokens``, ``output_tokens``, ``total_tokens``).

``ResponseShape`` is what ``delivery.GenerationReply`` needs of a reply's shape (``whole``,
``prompt_param``, ``param_names``); ``finish`` builds the final object and keeps it in the
store (``response_store``) when the request asked to.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar

from ..generation.results import GenerationStats
from ..generation.sampling import SamplingConfig
from .response_store import ResponseStore

__all__ = [
    "ResponseShape",
    "call_item",
    "message_item",
    "new_id",
    "response_usage",
    "text_part",
]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingConfig)}
_SHUTDOWN = {
    "code": "server_shutting_down",
    "message": "the server is shutting down; the response was cut short, retry it later",
}


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{secrets.token_hex(16)}"


def response_usage(stats: GenerationStats | None) -> dict[str, Any]:
    prompt = stats.prompt_tokens if stats else 0
    output = stats.completion_tokens if stats else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": stats.reused_prompt_tokens if stats else 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(mid: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    """An assistant message; ``text`` None: one just opened, with no content part yet."""
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}


def call_item(fid: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A function call item of a tool call in chat's shape (``{"id", "function"}``)."""
    function = call["function"]
    return {
        "type": "function_call",
        "id": fid,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if status == "completed" else "",
        "status": status,
    }


@dataclass(frozen=True)
class ResponseShape:
    """One response's identity, the request fields it echoes, and where it is kept."""

    rid: str
    model: str
    created: int
    echo: dict[str, Any]
    sampling: dict[str, Any]
    conversation: list[dict[str, Any]]  # the messages before its output (what is kept)
    store: ResponseStore | None  # None: store=false
    prompt_param: ClassVar[str] = "input"
    param_names: ClassVar[dict[str, str]] = {
        "max_new_tokens": "max_output_tokens",
        "response_format": "text.format",
    }

    def response(
        self,
        status: str = "in_progress",
        output: list[dict[str, Any]] | None = None,
        stats: GenerationStats | None = None,
    ) -> dict[str, Any]:
        """The response object; ``usage`` only once it has ended."""
        body: dict[str, Any] = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output or [],
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "temperature": self.sampling.get("temperature", _DEFAULTS["temperature"]),
            "top_p": self.sampling.get("top_p", _DEFAULTS["top_p"]),
            "truncation": "disabled",
            "usage": None,
            **self.echo,
        }
        if status != "in_progress":
            body["usage"] = response_usage(stats)
        return body

    def whole(
        self,
        text: str,
        reason: str | None,
        stats: GenerationStats,
        tool_calls: tuple[dict[str, Any], ...] = (),
        token_logprobs: tuple[Any, ...] = (),  # never asked for: top_logprobs is refused
    ) -> dict[str, Any]:
        """The non-streamed reply: its message (when it has text, or no calls), its calls."""
        output = []
        if text or not tool_calls:
            output.append(message_item(new_id("msg"), text))
        output += [call_item(new_id("fc"), call) for call in tool_calls]
        return self.finish(output, text, reason, stats, tool_calls)

    def finish(
        self,
        output: list[dict[str, Any]],
        text: str,
        reason: str | None,
        stats: GenerationStats | None,
        tool_calls: tuple[dict[str, Any], ...] = (),
    ) -> dict[str, Any]:
        """The final response object, kept when the request asked to (not a failed one)."""
        status = {"length": "incomplete", "cancelled": "failed"}.get(reason or "", "completed")
        body = self.response(status, output, stats)
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "failed":
            body["error"] = dict(_SHUTDOWN)
            return body
        if self.store is not None:
            reply: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                reply = {
                    "role": "assistant",
                    "content": text or None,
                    "tool_calls": list(tool_calls),
                }
            self.store.put(self.rid, body, [*self.conversation, reply])
        return body
