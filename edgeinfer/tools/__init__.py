"""Tool (function) calls: ``model.chat(messages, tools=[...], tool_choice=...)``.

- ``spec``: ``tools`` and ``tool_choice`` in OpenAI's shapes, checked where they enter;
- ``schema``: a tool's ``parameters`` checked as a schema, and arguments checked against it;
- ``formats``: the call syntax of a chat template's family (hermes, llama3, mistral) or the
  documented generic format for templates that know no tools, and the grammar that forces a
  call (``tool_choice`` "required" or a named function);
- ``parse``: calls found in a reply and checked; ``stream``: the chat's stream with calls
  handed out as they complete; ``request``: one chat request with tools;
- ``markers``: call markers a tokenizer holds as tokens (Qwen 2.5's ``<tool_call>``), and
  the tool-result markers that end a reply; ``preamble``: a call written outside the
  format; ``retry``: the one retry of ``auto``; ``run``: ``tool_chat``, a chat with tools
  from start to end, with ``auto`` ("plain" or "grammar") and ``retry`` named.

The result carries ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
"arguments": JSON text}}]``) and ``finish_reason="tool_calls"``; a call that is malformed,
names an unknown function or whose arguments fail the schema is never handed out: the
reply's text keeps it and ``tool_call_error`` says why.
"""

from __future__ import annotations

from .formats import GENERIC_PREAMBLE, CallFormat, detect_format
from .request import ToolRequest
from .run import tool_chat
from .spec import Tool, ToolChoice, check_tool_choice, check_tools

__all__ = [
    "GENERIC_PREAMBLE",
    "CallFormat",
    "Tool",
    "ToolChoice",
    "ToolRequest",
    "check_tool_choice",
    "check_tools",
    "detect_format",
    "tool_chat",
]
