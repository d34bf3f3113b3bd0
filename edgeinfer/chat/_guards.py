"""Size checks that run before a step of an untrusted chat template which could make a huge
value in one go (one C call, out of reach of the deadline): ``'x' * n``, ``n ** m``, widths,
``replace``, ``join``, ``format``, ``%``, ``str()`` of a container. Each estimates what the
step would make, in the units of _budget, and the budget refuses it when too big.
"""

from __future__ import annotations

import re
import string
import sys
from collections.abc import Mapping, Sequence
from types import BuiltinMethodType, FunctionType
from typing import Any

from ._budget import Budget, current, text_size, units_of


def binop_size(op: str, left: Any, right: Any) -> int:
    """Units the result of ``left op right`` would hold; 0 where it is bounded anyway."""
    if op == "+":
        return units_of(left) + units_of(right) if type(left) is type(right) else 0
    if op == "*":
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int) and isinstance(seq, (str, bytes, list, tuple)):
            return units_of(seq) * max(times, 0)
    elif op == "%" and isinstance(left, str):
        values = tuple(right.values()) if isinstance(right, dict) else right
        return percent_size(left, values if isinstance(values, tuple) else (values,))
    return 0


def power_bits(base: Any, exponent: Any) -> int:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        return (abs(base).bit_length() - 1) * exponent
    return 0


def _spec_width(spec: str) -> int:
    """The largest number written in a format spec (a width or a precision)."""
    digits = "".join(c if c.isdigit() else " " for c in spec).split()
    return max((int(d) if len(d) < 20 else sys.maxsize for d in digits), default=0)


_PERCENT_SPEC = re.compile(r"%(\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.?)")


def percent_size(fmt: str, values: tuple[Any, ...]) -> int:
    """Characters ``fmt % values`` may make: widths and precisions count, ``*`` ones too."""
    specs, width, position = _PERCENT_SPEC.findall(fmt), 0, 0
    for key, *sizes, conversion in specs:
        if conversion == "%":
            continue
        for size in sizes:
            if size == "*":  # the width is the next value
                star = values[position] if position < len(values) else 0
                width = max(width, star if isinstance(star, int) else 0)
                position += 1
            elif size:
                width = max(width, _spec_width(size))
        position += 0 if key else 1
    return len(fmt) + len(specs) * (width + _largest_text(values))


def format_size(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """Characters ``fmt.format(*args, **kwargs)`` may make, nested widths (``{:{}}``) too."""
    fields, width, values = 0, 0, (*args, *kwargs.values())
    for _literal, name, spec, _conversion in string.Formatter().parse(fmt):
        if name is not None:
            fields += 1 + (spec or "").count("{")
            width = max(width, _spec_width(spec or ""))
            if "{" in (spec or ""):
                width = max([width, *(v for v in values if isinstance(v, int))])
    return len(fmt) + fields * (width + _largest_text(values))


def _largest_text(values: Sequence[Any]) -> int:
    stop = current().limit
    return max((text_size(v, stop) for v in values), default=0)


def replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(text, (str, bytes)) and type(old) is type(text) is type(new)):
        return 0
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def join_size(separator: Any, items: list[Any]) -> int:
    total, stop = len(separator) * len(items), current().limit
    for item in items:
        total += text_size(item, stop)
        if total > stop:
            break
    return total


def _as_text(budget: Budget, value: object, what: str) -> str:
    """``str(value)``, once its size is known to be within the limit."""
    if not isinstance(value, str):
        budget.over(text_size(value, budget.limit), what)
    return str(value)


def _guard_text_method(
    budget: Budget, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Checks a call of a str or bytes method; ``join``'s iterable comes back as a list."""
    text, name = method.__self__, method.__name__
    if name == "replace" and len(args) >= 2:
        budget.over(replace_size(text, *args[:3]), "replace()")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        tab = "\t" if isinstance(text, str) else b"\t"
        if isinstance(tabsize, int):
            budget.over(len(text) + text.count(tab) * tabsize, "expandtabs()")
    elif name == "join" and len(args) == 1:
        args = (list(args[0]),)
        budget.over(join_size(text, args[0]), "join()")
    elif name == "translate" and args and isinstance(text, str):
        budget.over(len(text) * max(1, text_size(args[0], budget.limit)), "translate()")
    return args


def guard_call(
    budget: Budget, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Checks a call of anything but a macro before it runs (see _guard_text_method)."""
    if type(func) is BuiltinMethodType:  # str.center(n), int.to_bytes(n): ints are sizes
        budget.ints(args, {k: v for k, v in kwargs.items() if not k.startswith("_")})
        if isinstance(func.__self__, (str, bytes)):
            return _guard_text_method(budget, func, args, kwargs)
    if type(func) is FunctionType and func.__name__ in ("format", "format_map"):
        inner = getattr(func, "__wrapped__", None)  # the sandbox's wrapper of str.format
        if isinstance(getattr(inner, "__self__", None), str):
            named = args[0] if func.__name__ == "format_map" and args else kwargs
            budget.over(format_size(inner.__self__, args, named), f"{func.__name__}()")
    return args


def guard_filter(
    name: str, budget: Budget, head: tuple[Any, ...], args: list[Any], kwargs: dict[str, Any]
) -> int:
    """Checks a filter call before it runs; returns about how many units it will go through.
    ``args[0]`` is the filtered value; ``head`` holds the context or environment the filter
    asked for. ``join`` and ``sum`` get their value as a list, so that the check does not use
    up an iterator."""
    if name in _SIZE_ARGUMENTS:
        budget.ints(args[1:], kwargs)
    value = args[0]
    if name in STRINGIFYING_FILTERS:
        size = text_size(value, budget.limit) * _SLOW_FILTERS.get(name, 1)
        budget.over(size, f"the {name} filter")
        return size
    if name == "join":
        args[0] = list(value)
        separator = _as_text(budget, args[1] if len(args) > 1 else kwargs.get("d", ""), name)
        budget.over(join_size(separator, args[0]), "the join filter")
    elif name == "replace" and len(args) >= 3:
        text = _as_text(budget, value, "the replace filter")
        budget.over(replace_size(text, *args[1:4]), "the replace filter")
    elif name == "format":
        text = _as_text(budget, value, "the format filter")
        budget.over(percent_size(text, (*args[1:], *kwargs.values())), "the format filter")
    elif name == "indent":
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        lines = value.count("\n") + 1 if isinstance(value, str) else 1
        size = text_size(value, budget.limit) + lines * _width(width)
        budget.over(size, "the indent filter")
    elif name == "tojson":
        indent = _width(args[1] if len(args) > 1 else kwargs.get("indent"))
        budget.over(text_size(value, budget.limit, indent), "the tojson filter")
    elif name == "sum":
        _numbers_only(budget, head, args, kwargs)
    return len(value) if isinstance(value, range) else units_of(args[0])


# filters whose integer arguments are widths or counts of what they make
_SIZE_ARGUMENTS = frozenset(
    {"batch", "center", "indent", "slice", "tojson", "truncate", "urlize", "wordwrap"}
)
TRACE_ABOVE = 4096  # units: library code going through fewer ends soon without a tracer
# Filters whose C code is slow per character (textwrap's regular expression: about 1 s per
# MB): their input counts this many times against the limit.
_SLOW_FILTERS = {"wordwrap": 8}


STRINGIFYING_FILTERS = frozenset(
    "capitalize center e escape forceescape lower pprint safe string striptags title trim "
    "truncate upper urlencode urlize wordcount wordwrap xmlattr".split()
)


def _width(width: object) -> int:
    """An indent given as a number of spaces or as a string (``indent``, ``tojson``)."""
    if isinstance(width, str):
        return len(width)
    return max(width, 0) if isinstance(width, int) else 0


def _numbers_only(
    budget: Budget, head: tuple[Any, ...], args: list[Any], kwargs: dict[str, Any]
) -> None:
    """``sum`` adds numbers only: adding up lists or strings copies quadratically inside one
    C call, out of reach of the deadline. The attribute, if any, is looked up here."""
    from jinja2.filters import make_attrgetter

    items = list(args[0])
    attribute = args[1] if len(args) > 1 else kwargs.get("attribute")
    if attribute is not None and head:
        items = [make_attrgetter(head[0], attribute)(item) for item in items]
        if len(args) > 1:
            args[1] = None
        else:
            kwargs["attribute"] = None
    start = args[2] if len(args) > 2 else kwargs.get("start", 0)
    if not all(isinstance(v, (int, float)) for v in (*items, start)):
        budget.refuse("the sum filter adds numbers only")
    args[0] = items
