"""Tool-call formats: which one a chat template speaks, how calls look in a reply, and the
grammar that forces one.

Families, detected from the template's text (as llama.cpp's server does):

- ``hermes`` (Hermes, Qwen 2.5/3): the template lists ``tools`` itself; a call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, results come back as
  ``role: "tool"`` messages the template wraps in ``<tool_response>``;
- ``llama3`` (Llama 3.1+): the reply is a JSON object ``{"name": ..., "parameters": {...}}``
  (after an optional ``<|python_tag|>``), results are ``role: "tool"`` (``ipython``) turns;
- ``mistral``: the reply is ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}``;
  call ids are 9 letters and digits, as Mistral's templates require;
- ``generic``: for templates that know no tools (the default model's): edgeinfer documents
  the tools itself. A system-prompt section (``GENERIC_PREAMBLE``, the tools as JSON inside
  ``<tools></tools>``) is added to the first system message (or becomes one); a call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per line; an assistant
  message's ``tool_calls`` are written into its content in that form; ``role: "tool"``
  results become a user message holding ``<tool_response name="...">result
  </tool_response>`` for each (consecutive results share one message, so templates that
  insist on alternating turns accept it).

Constrained generation (``tool_choice`` required or named) fixes the call's frame and the
function's name as literal text and lets llguidance hold the arguments to the function's
``parameters`` schema (a Lark grammar with ``%json``).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..generation.structured_bounds import MAX_GRAMMAR_BYTES
from .grammar import arguments_rules
from .spec import Tool, ToolChoice

__all__ = ["GENERIC_PREAMBLE", "CallFormat", "detect_format"]

MAX_PARALLEL_CALLS = 8  # calls a constrained reply may hold when parallel calls are allowed

GENERIC_PREAMBLE = (
    "You may call functions (tools) to help with the user's request. The functions are "
    "described by JSON schemas in <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one line per call, each exactly of the form\n"
    '<tool_call>{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}'
    "</tool_call>\nand nothing else. The results come back inside <tool_response> tags. "
    "When no function is needed, answer in plain text."
)


@dataclass(frozen=True)
class CallFormat:
    """One family's syntax: ``native``: the template renders tools and calls itself."""

    name: str
    native: bool
    open: str  # the text a call (or the block of calls) starts with
    close: str  # the text a single call ends with ("" where the reply's end closes it)
    arguments_key: str  # "arguments" or "parameters"

    def new_id(self) -> str:
        if self.name == "mistral":
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    def grammar(
        self,
        tools: Sequence[Tool],
        choice: ToolChoice,
        parallel: bool,
        tokens: Mapping[str, int] | None = None,
    ) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is a reply of one call
        (or up to MAX_PARALLEL_CALLS with ``parallel``) to the chosen functions, each with
        arguments valid under the function's schema. ``tokens``: marker text -> the id of
        the one token the tokenizer holds it as (markers.find_markers); such a marker may be
        written as that token or as its text."""
        chosen = [t for t in tools if choice.name in (None, t.name)]
        rules = [self._start(MAX_PARALLEL_CALLS - 1 if parallel else 0, tokens or {})]
        rules += self._call_rules(chosen, tokens or {})
        return _bounded("\n".join(rules), len(chosen))

    def auto_grammar(
        self, tools: Sequence[Tool], parallel: bool, tokens: Mapping[str, int] | None = None
    ) -> str:
        """The grammar of ``tool_choice="auto"`` constrained: any text that never spells the
        call opener, or calls, or such text followed by calls. The model chooses freely
        between answering and calling; once it opens a call, the call is held to a function
        and its schema. Tagged formats (hermes, generic) only.

        llguidance's lexer is greedy: a text lexeme followed by the opener's literal would
        swallow its first characters. So text and the opener that ends it are one lexeme
        (``OPENED``); the opener as a token (``<[id]>``) ends the text lexeme by itself."""
        assert self.name in ("hermes", "generic")
        tokens = tokens or {}
        more = MAX_PARALLEL_CALLS - 1 if parallel else 0
        opener = _regex_escape(_OPEN_TAG)
        start = "start: TEXT | calls | OPENED body more"
        if _OPEN_TAG in tokens:
            start += f" | TEXT <[{tokens[_OPEN_TAG]}]> body more"
        rules = [
            start,
            "calls: call more",
            f'more: ("\\n" call){{0,{more}}}' if more else 'more: ""',
            f"OPENED: /(?s:.+){opener}/ & ~/(?s:.*{opener}.+)/",
            f"TEXT: /(?s:.+)/ & ~/(?s:.*{opener}.*)/",
        ]
        rules += self._call_rules(list(tools), tokens)
        return _bounded("\n".join(rules), len(tools))

    def _call_rules(self, chosen: Sequence[Tool], tokens: Mapping[str, int]) -> list[str]:
        """``call``: one call to one of ``chosen``; ``body``: the same after its opener."""
        calls = " | ".join(f"call_{i}" for i in range(len(chosen)))
        bodies = " | ".join(f"body_{i}" for i in range(len(chosen)))
        rules = [f"call: {calls}", f"body: {bodies}"]
        for i, tool in enumerate(chosen):
            head = json.dumps({"name": tool.name, self.arguments_key: 0})[:-2]  # '{..., "k": '
            opened, body = self._frame(_literal(head), f"args_{i}", tokens)
            rules.append(f"call_{i}: {opened} body_{i}".replace(":  ", ": "))
            rules.append(f"body_{i}: {body}")
            rules += arguments_rules(tool.parameters, f"args_{i}")
        return rules

    def _frame(self, head: str, args: str, tokens: Mapping[str, int]) -> tuple[str, str]:
        """A call's opener (as a grammar item; "" where there is none) and the rest."""
        if self.name in ("mistral", "llama3"):
            return "", f'{head} {args} "}}"'
        rest = _rest(self.open, _OPEN_TAG).strip()
        closed = _rest(self.close, _CLOSE_TAG, before=True) + _marked(_CLOSE_TAG, tokens)
        return _marked(_OPEN_TAG, tokens), f'{rest} {head} {args} "}}"{closed}'.strip()

    def _start(self, more: int, tokens: Mapping[str, int] | None = None) -> str:
        repeat = f"{{0,{more}}}" if more else ""
        if self.name == "mistral":
            tail = f' ("," " " call){repeat}' if more else ""
            return f'start: {_marked(self.open, tokens or {})} "[" call{tail} "]"'
        separator = '"; "' if self.name == "llama3" else '"\\n"'
        tail = f" ({separator} call){repeat}" if more else ""
        return f"start: call{tail}"


_OPEN_TAG, _CLOSE_TAG = "<tool_call>", "</tool_call>"


def _marked(text: str, tokens: Mapping[str, int]) -> str:
    """``text`` as a grammar item: its literal, or either its one token or its literal."""
    if text in tokens:
        return f"(<[{tokens[text]}]> | {_literal(text)})"
    return _literal(text)


def _rest(text: str, tag: str, before: bool = False) -> str:
    """The literal of what ``text`` (a format's open or close text) holds beside ``tag``."""
    rest = text.removesuffix(tag) if before else text.removeprefix(tag)
    if not rest:
        return ""
    return f" {_literal(rest)} " if before else f" {_literal(rest)}"


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def _regex_escape(text: str) -> str:
    """``text`` as a regex matching itself (only metacharacters escaped: ``\\<`` would be a
    word boundary)."""
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


def _bounded(grammar: str, functions: int) -> str:
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(
            f"tool_choice: the grammar that forces a call to {functions} function(s) is "
            f"{len(grammar.encode()):,} bytes, over the limit of {MAX_GRAMMAR_BYTES:,}; "
            "name one function in tool_choice, or offer fewer or smaller tools"
        )
    return grammar


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


FORMATS = {
    "hermes": CallFormat("hermes", True, "<tool_call>\n", "\n</tool_call>", "arguments"),
    "llama3": CallFormat("llama3", True, "", "", "parameters"),
    "mistral": CallFormat("mistral", True, "[TOOL_CALLS]", "", "arguments"),
    "generic": CallFormat("generic", False, "<tool_call>", "</tool_call>", "arguments"),
}

_TOOLS_VARIABLE = re.compile(r"\btools\b")


def detect_format(template: str | None) -> CallFormat:
    """The call format ``template`` (a Jinja chat template's text) speaks; ``generic`` when
    it does not render ``tools`` in a family we know."""
    text = template or ""
    if not _TOOLS_VARIABLE.search(text):
        return FORMATS["generic"]
    if "<tool_call>" in text:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in text:
        return FORMATS["mistral"]
    if "<|start_header_id|>" in text and ("<|python_tag|>" in text or "ipython" in text):
        return FORMATS["llama3"]
    return FORMATS["generic"]


# -- the generic format's messages ----------------------------------------------------------


def generic_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
) -> list[dict[str, Any]]:
    """``messages`` (checked, arguments as objects) as plain role/content messages in the
    generic format, with the tools section in the system message when ``tools`` are given."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            block = _response(message)
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
        elif role == "assistant" and message.get("tool_calls"):
            calls = [_generic_call(call) for call in message["tool_calls"]]
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": "\n".join([text, *calls]).lstrip("\n")})
        else:
            out.append({"role": role, "content": message.get("content") or ""})
    for message in out:
        message.pop("_results", None)
    if tools:
        section = GENERIC_PREAMBLE.format(
            tools="\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
        )
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}".lstrip("\n")
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _generic_call(call: Mapping[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>"


def _response(message: Mapping[str, Any]) -> str:
    name = message.get("name") or ""
    return f'<tool_response name="{name}">\n{message.get("content") or ""}\n</tool_response>'
