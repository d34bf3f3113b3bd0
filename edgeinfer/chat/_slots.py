"""Where the caller's strings lie in a rendered chat prompt, found by construction.

The template renders twice: once with the messages as given, once with every string the
caller wrote (contents, names, tool call ids and arguments, tool descriptions, keys...)
replaced by a sentinel, a random name that neither the template nor any message holds. That
second render, the skeleton, is the template's own text, with sentinels where the caller's
strings go. The prompt is then read against the skeleton piece by piece: the template's
text exactly as in the skeleton and, at each sentinel, its string as the template writes
it (as given, trimmed, as JSON, HTML or Python text). Nothing searches the prompt for a
message's text, so content that repeats the template's markup (``<|im_start|>system``)
cannot be mistaken for the template's own: each candidate is the string's own text, read
at the one position the reading has reached, and the candidates of one string differ only in
whitespace at their ends or in escapes, so no choice among them moves the template's text
into a message's by more than that whitespace. A template that cuts or rewrites a string
otherwise gives no reading (None).

Strings of letters, digits, ``_`` and ``-`` only (roles, types, function names, most keys)
and blank strings cannot spell markup: they stay as they are, so templates that test them
take the same branches in both renders.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["Marks", "Piece", "RenderedChat", "align"]

_PLAIN = re.compile(r"[A-Za-z0-9_\-]*")
MAX_DEPTH = 200  # nesting of a message's values that marking walks
MAX_STEPS = 200_000  # candidate texts tried while aligning one prompt
Piece = tuple[str, bool]  # (text, True where it is a string the caller wrote)


@dataclass(frozen=True)
class RenderedChat:
    """A rendered prompt and what of it the template wrote.

    ``skeleton`` is the render with the caller's strings replaced by sentinels (None where
    the template refused those), ``pieces`` the prompt cut into the template's text and the
    caller's strings (None where the template changed a string in a way not traced), and
    ``values`` the caller's strings that were replaced.
    """

    text: str
    skeleton: str | None
    pieces: tuple[Piece, ...] | None
    values: tuple[str, ...]


class Marks:
    """The caller's strings of one request, each with its sentinel."""

    def __init__(self, avoid: str, *holders: Any) -> None:
        self.values: list[str] = []
        self._index: dict[str, int] = {}
        self._seen: list[str] = []  # every string met, plain ones too
        for holder in holders:
            self._collect(holder, 0)
        self.prefix = self._fresh_prefix(avoid)
        self.pattern = re.compile(re.escape(self.prefix) + r"(\d+)x")

    def _fresh_prefix(self, avoid: str) -> str:
        while True:
            prefix = "q" + secrets.token_hex(10) + "n"
            if prefix not in avoid and not any(prefix in v for v in self._seen):
                return prefix

    def _collect(self, value: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise InvalidRequestError(
                f"a message holds values nested more than {MAX_DEPTH} deep; flatten them"
            )
        if isinstance(value, Mapping):
            for key, item in value.items():
                self._collect(key, depth + 1)
                self._collect(item, depth + 1)
        elif isinstance(value, (list, tuple, Set)):
            for item in value:
                self._collect(item, depth + 1)
        elif not isinstance(value, (int, float, type(None))):
            text = _text(value)
            self._seen.append(text)
            if not _plain(text) and text not in self._index:
                self._index[text] = len(self.values)
                self.values.append(text)

    def mark(self, value: Any) -> Any:
        """``value`` with each of the caller's strings in it replaced by its sentinel (other
        values that a template would write as text, such as bytes, too)."""
        if isinstance(value, Mapping):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.mark(v) for v in value)
        if isinstance(value, Set):
            return {self.mark(v) for v in value}
        if isinstance(value, (int, float, type(None))):
            return value
        index = self._index.get(_text(value))
        return value if index is None else f"{self.prefix}{index}x"


def _text(value: object) -> str:
    return value if isinstance(value, str) else str(value)


def _plain(text: str) -> bool:
    return _PLAIN.fullmatch(text) is not None or text.isspace()


def _trims(text: str) -> Iterable[str]:
    yield from (text, text.strip(), text.lstrip(), text.rstrip())
    yield from (text.strip("\n"), text.lstrip("\n"), text.rstrip("\n"))


def written(value: str, encoders: Sequence[Callable[[str], str]]) -> list[str]:
    """The texts a template may make of ``value``, most likely first: as given, trimmed, and
    each encoder's (JSON, HTML...)."""
    texts = dict.fromkeys(_trims(value))
    for encode in encoders:
        texts.setdefault(encode(value))
    return list(texts)


def align(
    text: str, skeleton: str, marks: Marks, encoders: Sequence[Callable[[str], str]]
) -> tuple[Piece, ...] | None:
    """``text`` cut into the skeleton's template text and, at each sentinel, the text the
    template made of that sentinel's string; None when no such reading gives ``text``."""
    parts = marks.pattern.split(skeleton)
    template, slots = parts[0::2], [marks.values[int(i)] for i in parts[1::2]]
    if not text.startswith(template[0]):
        return None
    choices: dict[str, list[str]] = {}
    # depth-first over the slots; a node is (slot, position, parent node, text chosen)
    stack: list[tuple[int, int, Any, str]] = [(0, len(template[0]), None, "")]
    seen: set[tuple[int, int]] = set()
    steps = 0
    while stack:
        node = stack.pop()
        slot, pos = node[0], node[1]
        if slot == len(slots):
            if pos == len(text):
                return _pieces(template, node)
            continue
        if (slot, pos) in seen:
            continue
        seen.add((slot, pos))
        value, follow = slots[slot], template[slot + 1]
        if value not in choices:
            choices[value] = written(value, encoders)
        for choice in reversed(choices[value]):
            steps += 1
            if steps > MAX_STEPS:
                return None
            end = pos + len(choice)
            if text.startswith(choice, pos) and text.startswith(follow, end):
                stack.append((slot + 1, end + len(follow), node, choice))
    return None


def _pieces(template: list[str], node: Any) -> tuple[Piece, ...]:
    chosen = []
    while node[2] is not None:
        chosen.append(node[3])
        node = node[2]
    chosen.reverse()
    pieces: list[Piece] = [(template[0], False)]
    for choice, follow in zip(chosen, template[1:], strict=True):
        pieces += [(choice, True), (follow, False)]
    return tuple(p for p in pieces if p[0])
