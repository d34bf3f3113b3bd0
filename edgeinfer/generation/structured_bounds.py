"""Bounds on the structured-output formats, checked before llguidance compiles them.

One function per input kind: :func:`check_schema` (JSON schemas, also those inlined in a
grammar with ``%json``), :func:`check_regex` (patterns, also a schema's ``pattern`` and a
grammar's ``/.../``), :func:`check_grammar` (Lark) and :func:`check_choices`. Each refuses
with an ``InvalidRequestError`` naming the bound; none of them recurses, so a structure
nested past Python's own recursion limit is refused, not a ``RecursionError``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import InvalidRequestError, short_repr

__all__ = [
    "MAX_CHOICES",
    "MAX_EXPANSION",
    "MAX_GRAMMAR_BYTES",
    "MAX_GRAMMAR_RULES",
    "MAX_NESTING",
    "MAX_REGEX_BYTES",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_REFS",
    "check_choices",
    "check_grammar",
    "check_regex",
    "check_schema",
]

# Bounds on what reaches llguidance. Measured (1.9.1, tests/test_structured_hostile.py and
# the report of issue 21): on an 8 MiB stack a $ref chain of 3,000 or a Lark rule chain of
# 3,000 segfaults, 1,000 does not; 2,000 alternatives in one rule or a repetition expanding
# past ~50,000 items fail mid-reply. The bounds sit 4-10x below, and compiles run on a
# 256 MiB stack (_COMPILE_STACK_BYTES), so neither alone must hold.
MAX_SCHEMA_BYTES = 64 * 1024  # the schema as JSON text
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays of the schema document
MAX_SCHEMA_NODES = 20_000  # values in the schema document
MAX_SCHEMA_REFS = 256  # "$ref" entries
MAX_ENTRIES = 1_000  # items of one array or keys of one object (enum, anyOf, properties)
MAX_REGEX_BYTES = 8 * 1024
MAX_NESTING = 32  # groups within groups (regex), parentheses and brackets (Lark)
MAX_EXPANSION = 10_000  # characters or items a pattern or rule spells out, repetitions expanded
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_GRAMMAR_RULES = 500
MAX_CHOICES = 1_000
MAX_CHOICE_BYTES = 1_024
MAX_CHOICES_BYTES = 64 * 1024
_MAX_INT = 2**63  # JSON numbers the engine holds exactly (int64 / uint64)


def _refuse(what: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"response_format {what} is refused: {why}")


def _utf8(text: str, what: str) -> int:
    """The UTF-8 size of ``text``; refused when it holds lone surrogates (no encoding)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise _refuse(what, f"it holds a lone surrogate at character {exc.start}") from exc


def check_schema(schema: Any, what: str = "json_schema") -> None:
    """Refuse a JSON schema that is not plain JSON or is too large, deep or long for the
    grammar compiler (see the MAX_SCHEMA_* bounds); its patterns go through check_regex.

    The walk is iterative, so a schema nested past Python's own recursion limit is refused,
    not a RecursionError."""
    stack: list[tuple[Any, int, str]] = [(schema, 0, "")]
    nodes = refs = size = 0
    while stack:
        value, depth, path = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _refuse(what, f"it has more than {MAX_SCHEMA_NODES} values")
        if isinstance(value, (dict, list)):
            if depth >= MAX_SCHEMA_DEPTH:
                raise _refuse(what, f"it nests deeper than {MAX_SCHEMA_DEPTH} levels at {path}")
            if len(value) > MAX_ENTRIES:
                raise _refuse(what, f"{path or 'the schema'} has more than {MAX_ENTRIES} entries")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                size += _schema_key(key, item, path, what) + 2
                refs += key == "$ref"
                stack.append((item, depth + 1, f"{path}/{key}"))
        else:
            size += _schema_scalar(value, path, what)
        if refs > MAX_SCHEMA_REFS:
            raise _refuse(what, f"it has more than {MAX_SCHEMA_REFS} $ref entries")
        if size > MAX_SCHEMA_BYTES:
            raise _refuse(what, f"it is larger than {MAX_SCHEMA_BYTES // 1024} KiB as JSON")


def _schema_key(key: Any, item: Any, path: str, what: str) -> int:
    """Check one member of an object (or, with an int key, an array); its key's size."""
    if isinstance(key, int):
        return 0
    if not isinstance(key, str):
        raise _refuse(
            what, f"{path or 'the schema'} has a key {short_repr(key)} that is not a string"
        )
    if key == "x-guidance":  # the engine's own options (patterns, limits) are not for requests
        raise _refuse(what, f"{path}/x-guidance (llguidance's options) cannot be set by a request")
    if key == "pattern" and isinstance(item, str):
        check_regex(item, f"{what} pattern at {path}")
    if key == "patternProperties" and isinstance(item, dict):
        for name in item:
            if isinstance(name, str):
                check_regex(name, f"{what} patternProperties key at {path}")
    return _utf8(key, f"{what} key at {path}")


def _schema_scalar(value: Any, path: str, what: str) -> int:
    where = path or "the schema"
    if isinstance(value, str):
        return _utf8(value, f"{what} string at {where}") + 2
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        if not -_MAX_INT <= value < _MAX_INT:
            raise _refuse(what, f"the integer at {where} is outside the 64-bit range")
        return 20
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _refuse(what, f"the number at {where} is {value} (not JSON)")
        return 24
    raise _refuse(what, f"{where} holds a {type(value).__name__}, which is not a JSON value")


def check_regex(pattern: Any, what: str = "regex pattern") -> None:
    """Refuse a pattern that is not a non-empty string, holds lone surrogates, or is too long,
    deep or large once its repetitions are spelled out (``(a{1000}){1000}``)."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError(f"response_format {what} must be a non-empty string")
    if _utf8(pattern, what) > MAX_REGEX_BYTES:
        raise _refuse(what, f"it is longer than {MAX_REGEX_BYTES // 1024} KiB")
    _Expansion(what).measure_regex(pattern)


_COUNT = re.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")
_BRACED_ESCAPE = re.compile(r"\\[xupPN]\{[^}]*\}")


class _Expansion:
    """How much a pattern spells out with its repetitions expanded, and how deep its groups
    nest: ``a{100}`` is 100, ``(ab|c){3}`` is 9 (alternatives are added, an over-count that
    only errs toward refusing); ``*`` and ``+`` are loops, not copies, and count once."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.frames: list[list[int]] = [[0, 0]]  # per open group: [finished branches, current]
        self.last = 0  # size of the last atom or group, the one a quantifier repeats

    def atom(self, size: int = 1) -> None:
        self.last = size
        self.add(size)

    def add(self, size: int) -> None:
        self.frames[-1][1] += size
        if sum(a + b for a, b in self.frames) > MAX_EXPANSION:
            raise _refuse(
                self.what,
                f"it spells out more than {MAX_EXPANSION} items once its repetitions are "
                "expanded; use smaller counts, or * and + for open-ended repetition",
            )

    def open(self) -> None:
        self.frames.append([0, 0])
        self.last = 0
        if len(self.frames) > MAX_NESTING + 1:
            raise _refuse(self.what, f"its groups nest deeper than {MAX_NESTING} levels")

    def close(self) -> None:
        if len(self.frames) == 1:  # unbalanced: the engine reports it; count it as a literal
            self.atom()
            return
        done, current = self.frames.pop()
        self.atom(max(done + current, 1))

    def branch(self) -> None:
        frame = self.frames[-1]
        frame[0] += frame[1]
        frame[1] = 0
        self.last = 0

    def repeat(self, low: str, comma: bool, high: str | None) -> None:
        """``{low}``, ``{low,}`` or ``{low,high}`` after the last atom."""
        first, second = (_count(low), _count(high or ""))
        times = max(first + (1 if comma and not high else 0), second, 1)
        self.add(self.last * (times - 1))
        self.last *= times

    def measure_regex(self, pattern: str) -> None:
        i, n = 0, len(pattern)
        while i < n:
            c = pattern[i]
            if c == "\\":
                braced = _BRACED_ESCAPE.match(pattern, i)
                i = braced.end() if braced else i + 2
                self.atom()
                continue
            if c == "[":
                i = _skip_class(pattern, i, self)
                self.atom()
                continue
            count = _COUNT.match(pattern, i) if c == "{" else None
            if count:
                self.repeat(count[1], bool(count[2]), count[3])
                i = count.end()
                continue
            self.symbol(c)
            i += 1

    def symbol(self, c: str) -> None:
        if c == "(":
            self.open()
        elif c == ")":
            self.close()
        elif c == "|":
            self.branch()
        elif c not in "*+?":
            self.atom()


def _count(digits: str) -> int:
    """A repetition count; past nine digits it is simply too large (and int() of thousands
    of digits is refused by Python itself)."""
    return 10**9 if len(digits) > 9 else int(digits or 0)


def check_choices(choices: Any) -> None:
    """Refuse choices that are not a list of non-empty strings, or too many or too long for
    one grammar rule (llguidance fails mid-reply past 2,000 alternatives)."""
    if not (
        isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)
    ):
        raise InvalidRequestError(
            "response_format choice needs choices: a non-empty list of non-empty strings"
        )
    if len(choices) > MAX_CHOICES:
        raise _refuse("choices", f"there are more than {MAX_CHOICES}")
    total = 0
    for i, choice in enumerate(choices):
        size = _utf8(choice, f"choice {i}")
        if size > MAX_CHOICE_BYTES:
            raise _refuse(f"choice {i}", f"it is longer than {MAX_CHOICE_BYTES} bytes")
        total += size
    if total > MAX_CHOICES_BYTES:
        raise _refuse("choices", f"together they exceed {MAX_CHOICES_BYTES // 1024} KiB")


# Lark's lexical pieces: comments, strings, regexes, inline JSON, repetition counts, rule
# heads (at a line start), brackets and alternatives; anything else is a name or an operator.
_LARK_TOKEN = re.compile(
    r"""(?P<comment>(?://|\#)[^\n]*)
      | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
      | (?P<regex>/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*)
      | (?P<json>%json\b)
      | (?P<count>\{\s*(?P<low>\d*)\s*(?P<comma>,\s*(?P<high>\d*)\s*)?\})
      | (?P<range>~\s*(?P<rlow>\d+)(?:\s*\.\.\s*(?P<rhigh>\d+))?)
      | (?P<head>^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?:\[[^\]\n]*\])?[ \t]*:)
      | (?P<symbol>[()\[\]|*+?])
      | (?P<name><[^>\n]*>|[\w.-]+)
      | (?P<space>[ \t\r]*\n|[ \t\r]+)
      | (?P<other>.)""",
    re.VERBOSE | re.MULTILINE,
)


def check_grammar(lark: Any, what: str = "grammar") -> None:
    """Refuse a Lark grammar that is not a non-empty string or is too large, has too many
    rules, nests too deeply or spells out too much; its regexes and inline ``%json``
    schemas go through check_regex and check_schema."""
    if not isinstance(lark, str) or not lark:
        raise InvalidRequestError("response_format grammar needs a non-empty Lark grammar (lark)")
    if _utf8(lark, what) > MAX_GRAMMAR_BYTES:
        raise _refuse(what, f"it is larger than {MAX_GRAMMAR_BYTES // 1024} KiB")
    rules = 0
    measure = _Expansion(what)
    i = 0
    while i < len(lark):
        token = _LARK_TOKEN.match(lark, i)
        assert token is not None  # "other" matches any character
        i = token.end()
        kind = token.lastgroup
        if kind == "head":
            rules += 1
            if rules > MAX_GRAMMAR_RULES:
                raise _refuse(what, f"it has more than {MAX_GRAMMAR_RULES} rules")
            measure = _Expansion(f"{what} rule {token.group().strip().rstrip(':').strip()}")
        elif kind == "json":
            i = _inline_schema(lark, i, what)
            measure.atom()
        else:
            _lark_piece(kind, token, measure)


def _lark_piece(kind: str | None, token: re.Match[str], measure: _Expansion) -> None:
    if kind == "regex":
        body = token.group()
        check_regex(body[1 : body.rindex("/")], f"{measure.what} regex")
        measure.atom()
    elif kind == "count":
        measure.repeat(token["low"], bool(token["comma"]), token["high"])
    elif kind == "range":
        measure.repeat(token["rlow"], token["rhigh"] is not None, token["rhigh"])
    elif kind == "symbol":
        c = token.group()
        if c in "([":
            measure.open()
        elif c in ")]":
            measure.close()
        else:
            measure.symbol(c)
    elif kind in ("string", "name", "other"):
        measure.atom()


def _inline_schema(lark: str, i: int, what: str) -> int:
    """Check the ``%json {...}`` schema starting after ``lark[:i]``; the index after it."""
    from ..bounded_json import parse_json

    start = lark.find("{", i)
    end = _json_end(lark, start) if start >= 0 and not lark[i:start].strip() else -1
    if end < 0:
        raise _refuse(what, "a %json is not followed by one JSON object")
    text = lark[start:end]
    schema = parse_json(text, what=f"{what} %json", max_bytes=MAX_SCHEMA_BYTES)
    check_schema(schema, f"{what} %json")
    return end


def _json_end(text: str, start: int) -> int:
    """The index after the JSON object at ``text[start]`` (``{``), or -1 if it never ends."""
    depth, i, in_string = 0, start, False
    while i < len(text):
        c = text[i]
        if in_string:
            i += 2 if c == "\\" else 1
            in_string = c != '"'
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _skip_class(pattern: str, i: int, measure: _Expansion) -> int:
    """The index after the character class starting at ``pattern[i]`` (``[``); classes nest
    (``[a-z&&[^x]]``), and a ``]`` first in a class is a literal."""
    depth, i, n = 0, i, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            if depth > MAX_NESTING:
                raise _refuse(measure.what, f"its classes nest deeper than {MAX_NESTING} levels")
            i += 1
            i += pattern.startswith("^", i)
            i += pattern.startswith("]", i)
            continue
        i += 1
        if c == "]":
            depth -= 1
            if depth == 0:
                return i
    return n
