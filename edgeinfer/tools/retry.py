"""The one retry of ``tool_choice="auto"`` (``retry=True``): what asks again, and when.

A reply under auto is asked again once, from the same conversation, when it

- made no valid call but opened one that failed: malformed, an unknown function, arguments
  off the schema, or an opener left unclosed (the bare preamble of a call): asked again
  with the call **forced** (to the function the failed call named, if it names a tool);
- wrote a call outside the format (preamble.py: a JSON object naming a tool, bare or in a
  Markdown fence): forced the same way, to that function;
- only repeated the calls whose results end the conversation (a call in the format with
  the same function and arguments), or began, outside the format, a call to a function
  whose results end it (Qwen2.5-Coder restates its call, or the call with its result, as
  JSON instead of answering): asked again with tool_choice **"none"**, so the reply is an
  answer in text.

What was handed out before the failed part stays; the failed part is never handed out. A
second reply that fails is reported as usual: there is no third try.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..generation.results import TokenStream
from .markers import ReplyText

__all__ = ["RetryPlan", "answered_calls", "call_key"]

CALL, TEXT = "call", "text"  # what the second try is forced to


@dataclass(frozen=True)
class RetryPlan:
    """``rerun(kind, name)``: the stream of the second try (kind CALL, forced to ``name``
    or any tool; kind TEXT, under tool_choice "none") and how to read its text;
    ``answered``: the keys (call_key) of the calls whose results end the conversation."""

    rerun: Callable[[str, str | None], tuple[TokenStream, ReplyText]]
    answered: frozenset[tuple[str, str]] = frozenset()

    @property
    def answered_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.answered)


def call_key(name: Any, arguments: Any) -> tuple[str, str]:
    """A call as its function and canonical arguments (JSON, keys sorted)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    try:
        text = json.dumps(arguments, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(arguments)
    return str(name), text


def answered_calls(messages: Sequence[Mapping[str, Any]]) -> frozenset[tuple[str, str]]:
    """The calls of the last assistant message, when the conversation ends with results to
    them (tool messages only after it); empty otherwise. ``messages`` are checked ones."""
    keys: set[tuple[str, str]] = set()
    for message in reversed(messages):
        role = message.get("role")
        if role == "tool":
            continue
        if role == "assistant" and message.get("tool_calls") and message is not messages[-1]:
            for call in message["tool_calls"]:
                function = call.get("function", {})
                keys.add(call_key(function.get("name"), function.get("arguments")))
        break
    return frozenset(keys)
