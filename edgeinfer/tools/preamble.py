"""A call written outside the format: the preamble the retry looks for.

Qwen2.5-Coder, asked with tools under ``auto``, often writes its call as a JSON object in a
Markdown fence (````json\\n{"name": "get_weather", "arguments": ...}````) instead of
``<tool_call>`` tags. The start of such a text, up to the function's name, is read here:
optionally a fence (three backticks, optionally ``json``), then ``{"name": "<function>"``
with JSON whitespace between (the brace may be doubled, ``{{"name": ...``, as the models
write it now and then); the function must be one of the tools. ``match`` says whether
a text is that preamble, may still become it as more text comes, or cannot.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["NO", "PARTIAL", "YES", "find", "match"]

NO, PARTIAL, YES = "no", "partial", "yes"
_SPACE = " \t\r\n"
_STARTS = "`{"


def _literal(text: str, at: int, word: str) -> tuple[str, int]:
    """Whether ``word`` is at ``at`` (YES, with the position after it), cut by the end of
    ``text`` (PARTIAL) or not there (NO)."""
    piece = text[at : at + len(word)]
    if piece == word:
        return YES, at + len(word)
    return (PARTIAL if word.startswith(piece) and at + len(piece) == len(text) else NO), at


def _spaces(text: str, at: int) -> int:
    while at < len(text) and text[at] in _SPACE:
        at += 1
    return at


def match(text: str, names: Collection[str]) -> tuple[str, str | None]:
    """Whether ``text`` begins with the preamble of a call to one of ``names``: YES with the
    name, PARTIAL (it may, once more text comes), or NO."""
    at = 0
    if text.startswith("`") or text.startswith("``"):
        state, at = _literal(text, 0, "```")
        if state != YES:
            return state, None
        state, after = _literal(text, at, "json")
        if state == PARTIAL:
            return PARTIAL, None
        at = after
    at = _spaces(text, at)
    if at == len(text):
        return PARTIAL, None
    if text[at] != "{":
        return NO, None
    while at < len(text) and text[at] == "{":  # one brace, or a run of them ({{"name": ...)
        at += 1
    for word in ('"name"', ":", '"'):
        at = _spaces(text, at)
        if at == len(text):
            return PARTIAL, None
        state, at = _literal(text, at, word)
        if state != YES:
            return state, None
    end = text.find('"', at)
    if end < 0:
        rest = text[at:]
        return (PARTIAL if any(n.startswith(rest) for n in names) else NO), None
    name = text[at:end]
    return (YES, name) if name in names else (NO, None)


def find(text: str, names: Collection[str]) -> tuple[int, str, str | None]:
    """The first place in ``text`` where a preamble begins (YES) or may begin (PARTIAL):
    its index, the state and the name; (-1, NO, None) when there is none."""
    for at, char in enumerate(text):
        if char not in _STARTS:
            continue
        state, name = match(text[at:], names)
        if state != NO:
            return at, state, name
    return -1, NO, None
