"""Values of results files for the figure checker (tests/figures.py): one field of one file
(``Field``), and arithmetic, reductions and picks over fields, each printable as the
expression it is, so a wrong figure's message names the field it was checked against."""

from __future__ import annotations

import functools
import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.errors import EdgeInferError

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


class SourceError(EdgeInferError):
    """A source names a field its results file does not have: fix the source or the file."""


class Expr:
    def value(self) -> Any:
        raise NotImplementedError

    def files(self) -> frozenset[str]:
        raise NotImplementedError

    def __add__(self, other: object) -> Expr:
        return Op("+", self, expr_of(other))

    def __sub__(self, other: object) -> Expr:
        return Op("-", self, expr_of(other))

    def __rsub__(self, other: object) -> Expr:
        return Op("-", expr_of(other), self)

    def __mul__(self, other: object) -> Expr:
        return Op("*", self, expr_of(other))

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> Expr:
        return Op("/", self, expr_of(other))

    def __rtruediv__(self, other: object) -> Expr:
        return Op("/", expr_of(other), self)


def expr_of(value: object) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Const(float(value))
    raise TypeError(f"not a figure's expression: {value!r}")


@dataclass(frozen=True, eq=False)
class Const(Expr):
    number: float

    def value(self) -> float:
        return self.number

    def files(self) -> frozenset[str]:
        return frozenset()

    def __str__(self) -> str:
        return f"{self.number:g}"


@dataclass(frozen=True)
class Where:
    """The one element of a list whose fields have these values."""

    items: tuple[tuple[str, Any], ...]

    def __str__(self) -> str:
        return "[" + ",".join(f"{k}={v}" for k, v in self.items) + "]"


@dataclass(frozen=True, eq=False)
class Field(Expr):
    """One field of one results file: keys of objects, list indexes, ``Where`` picks, and
    ``"*"`` for every element (a list, for ``median``, ``lo`` ...)."""

    file: str
    keys: tuple[Any, ...]

    def value(self) -> Any:
        return _walk(_load(self.file), self.keys, self)

    def files(self) -> frozenset[str]:
        return frozenset({self.file})

    def __str__(self) -> str:
        return f"{self.file}:" + "/".join(str(k) for k in self.keys)


@functools.cache
def _load(file: str) -> Any:
    path = RESULTS / file
    if not path.is_file():
        raise SourceError(f"no results file {file} under benchmarks/results/")
    return json.loads(path.read_text(encoding="utf-8"))


def _walk(node: Any, keys: tuple[Any, ...], where: Field) -> Any:
    if not keys:
        return node
    key, rest = keys[0], keys[1:]
    if key == "*":
        items = node.values() if isinstance(node, dict) else node
        if not isinstance(items, list) and not isinstance(node, dict):
            raise SourceError(f"{where}: '*' over a {type(node).__name__}")
        return [_walk(item, rest, where) for item in items]
    if isinstance(key, Where):
        found = [e for e in node if isinstance(e, dict) and all(
            e.get(k) == v for k, v in key.items)] if isinstance(node, list) else []  # fmt: skip
        if len(found) != 1:
            raise SourceError(f"{where}: {key} picks {len(found)} elements, not one")
        return _walk(found[0], rest, where)
    if isinstance(node, dict) and key in node:
        return _walk(node[key], rest, where)
    if isinstance(node, list) and isinstance(key, int) and -len(node) <= key < len(node):
        return _walk(node[key], rest, where)
    raise SourceError(f"{where}: no {key!r} there")


_OPS: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}


def number_of(value: Any, where: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SourceError(f"{where} is {value!r}, not a number")
    return float(value)


@dataclass(frozen=True, eq=False)
class Op(Expr):
    op: str
    a: Expr
    b: Expr

    def value(self) -> float:
        return _OPS[self.op](number_of(self.a.value(), self.a), number_of(self.b.value(), self.b))

    def files(self) -> frozenset[str]:
        return self.a.files() | self.b.files()

    def __str__(self) -> str:
        return f"({self.a} {self.op} {self.b})"


_REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median,
    "min": min,
    "max": max,
    "mean": statistics.fmean,
    "sum": sum,
}


@dataclass(frozen=True, eq=False)
class Reduce(Expr):
    fn: str
    inner: Expr

    def value(self) -> float:
        values = self.inner.value()
        if not isinstance(values, list) or not values:
            raise SourceError(f"{self}: {self.fn} of {values!r}, not a list of numbers")
        return _REDUCERS[self.fn]([number_of(v, self.inner) for v in values])

    def files(self) -> frozenset[str]:
        return self.inner.files()

    def __str__(self) -> str:
        return f"{self.fn}({self.inner})"


@dataclass(frozen=True, eq=False)
class Join(Expr):
    """Several fields' lists (or numbers) as one list, for ``lo``/``hi`` over all of them."""

    parts: tuple[Expr, ...]

    def value(self) -> list[Any]:
        out: list[Any] = []
        for part in self.parts:
            v = part.value()
            out.extend(v if isinstance(v, list) else [v])
        return out

    def files(self) -> frozenset[str]:
        return frozenset().union(*(p.files() for p in self.parts))

    def __str__(self) -> str:
        return "each(" + ", ".join(str(p) for p in self.parts) + ")"


@dataclass(frozen=True, eq=False)
class Matched(Expr):
    """The number a text field holds where ``pattern``'s one group stands (an error's
    "needs 660 MB")."""

    inner: Expr
    pattern: str

    def value(self) -> float:
        text = self.inner.value()
        m = re.search(self.pattern, text) if isinstance(text, str) else None
        if m is None:
            raise SourceError(f"{self}: no match in {text!r}")
        return float(m.group(1))

    def files(self) -> frozenset[str]:
        return self.inner.files()

    def __str__(self) -> str:
        return f"{self.inner} ~ /{self.pattern}/"


def matched(inner: Expr, pattern: str) -> Expr:
    return Matched(inner, pattern)


def each(*parts: Expr) -> Expr:
    return Join(tuple(parts))


def results(file: str) -> Callable[..., Field]:
    """``results("a.json")("summary", "2048", "tok_s")``: a field of that file; a dict key
    is a ``Where`` pick (``{"engine": "edgeinfer"}``)."""

    def field(*keys: Any) -> Field:
        made = tuple(Where(tuple(k.items())) if isinstance(k, dict) else k for k in keys)
        return Field(file, made)

    return field


def median(e: Expr) -> Expr:
    return Reduce("median", e)


def lo(e: Expr) -> Expr:
    return Reduce("min", e)


def hi(e: Expr) -> Expr:
    return Reduce("max", e)


def mean(e: Expr) -> Expr:
    return Reduce("mean", e)


def total(e: Expr) -> Expr:
    return Reduce("sum", e)


def under(field: Callable[..., Field], *prefix: Any) -> Callable[..., Field]:
    """The fields below ``prefix``: ``under(R, "cases", 0)("peak_rss")``."""
    return lambda *keys: field(*prefix, *keys)
