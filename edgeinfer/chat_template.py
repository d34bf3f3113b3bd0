"""Render a model's own chat template in a sandbox, in bounded time and size.

Templates come from model files, so they are untrusted code. They run in Jinja2's
``ImmutableSandboxedEnvironment`` (no private attributes, no mutation of our data) with only
the variables chat templates expect, and with bounds the sandbox alone does not give:

- time: compiling and rendering end ``RENDER_DEADLINE_S`` after they began. The clock is
  checked at each ``{% for %}`` step, call and item of a lazy filter; while Jinja2 compiles,
  and while a filter or other library code runs, a trace function (this thread only, chained
  to any tracer already there, removed afterwards) checks it at every Python call;
- size: every value the template makes (operators, ``~``, calls, filters, slices, macro and
  block bodies) and the output hold at most ``limit`` units: a character, 8 per list item,
  32 per dict entry. The limit is ``OUTPUT_LIMIT_CHARS`` plus ``OUTPUT_LIMIT_PER_MESSAGE_CHAR``
  per character of the messages. Steps that could grow a value without bound in one go
  (``'x' * n``, ``n ** m``, widths, ``replace``, ``join``, ``format``, ``%``, ``str()`` of a
  container) are refused before they run;
- memory: all values made in one render add up to at most ``WORK_FACTOR`` times the limit,
  integers hold at most ``INT_LIMIT_BITS`` bits, calls (macros, ``caller()``, recursive loops,
  blocks) nest at most ``CALL_DEPTH_LIMIT`` deep.

Every failure, whatever its cause, is a ChatTemplateError that says what went wrong.
"""

from __future__ import annotations

import datetime
import re
import reprlib
import string
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from functools import lru_cache, wraps
from types import BuiltinMethodType, FrameType, FunctionType, GeneratorType
from typing import Any, NoReturn, TypeVar

from .errors import ChatTemplateError, InvalidRequestError

__all__ = [
    "CALL_DEPTH_LIMIT",
    "INT_LIMIT_BITS",
    "OUTPUT_LIMIT_CHARS",
    "OUTPUT_LIMIT_PER_MESSAGE_CHAR",
    "RENDER_DEADLINE_S",
    "WORK_FACTOR",
    "render_chat",
    "validate_messages",
]

RENDER_DEADLINE_S = 2.0  # wall-clock seconds for compiling and rendering one prompt
OUTPUT_LIMIT_CHARS = 4 * 2**20  # units any one value, or the output, may hold ...
OUTPUT_LIMIT_PER_MESSAGE_CHAR = 4  # ... plus this many per character of the messages
WORK_FACTOR = 16  # all values made in one render: at most this many times the limit
INT_LIMIT_BITS = 4096
CALL_DEPTH_LIMIT = 64
_ITEM_UNITS = 8  # a list or tuple item: one pointer
_ENTRY_UNITS = 32  # a dict or set entry: hash, key and value
_EACH = "edgeinfer_each"  # the filter every {% for %} iterates through
_CONTAINERS = (list, tuple, dict, set, frozenset)
_CONTAINER_UNITS = 64  # what a container made by the template costs at least
_CACHED_ABOVE = 256  # text size from which a made container's size is remembered

_ROLES = frozenset({"system", "user", "assistant", "tool"})
_T = TypeVar("_T")
_TraceFunction = Callable[[FrameType, str, Any], Any]
_local = threading.local()


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts; each needs a known role and string content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
        )
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] is {type(message).__name__}, not a dict")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}]['role']={_short(role)}; expected one of {sorted(_ROLES)}"
            )
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}]['content'] must be a string")
        checked.append(dict(message))
    return checked


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for ``messages``, as the model was trained to see it."""
    if not template:
        raise ChatTemplateError(
            "this model has no chat template; use generate()/stream() with a plain prompt"
        )
    if not isinstance(template, str):
        raise ChatTemplateError(f"the model's chat template is a {type(template).__name__}")
    checked = validate_messages(messages)
    limit = OUTPUT_LIMIT_CHARS + OUTPUT_LIMIT_PER_MESSAGE_CHAR * _messages_size(checked)
    budget = _Budget(limit, WORK_FACTOR * limit, time.monotonic() + RENDER_DEADLINE_S)
    context = {
        "messages": checked,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
    }
    return _bounded(budget, lambda: _compile_and_render(template, context, budget))


def _compile_and_render(template: str, context: dict[str, Any], budget: _Budget) -> str:
    budget.strict = False  # see _Budget.strict
    compiled = _compile(template)
    budget.strict = True
    chunks, total = [], 0
    stream = compiled.root_render_func(compiled.new_context(context))
    try:
        for chunk in stream:
            total += len(chunk)
            if total > budget.limit:
                budget.refuse(f"its output passed the limit of {budget.limit:,} characters")
            chunks.append(chunk)
    except Exception:
        compiled.environment.handle_exception()  # re-raised, traceback in template lines
    finally:
        stream.close()
    return "".join(chunks)


def _bounded(budget: _Budget, work: Callable[[], _T]) -> _T:
    """``work()`` within ``budget``; whatever goes wrong becomes a ChatTemplateError."""
    try:
        with _Guard(budget):
            return work()
    except ChatTemplateError:
        raise
    except _Abort as exc:  # not chained: its frames hold the big values it refused
        raise ChatTemplateError(f"the model's chat template failed: {exc}") from None
    except Exception as exc:  # anything the template's code raised, mapped at the edge
        raise _failure(exc) from exc


def _failure(exc: Exception) -> ChatTemplateError:
    from jinja2 import TemplateSyntaxError

    if isinstance(exc, TemplateSyntaxError):
        return ChatTemplateError(f"the model's chat template does not parse: {exc}")
    if isinstance(exc, RecursionError):
        detail = "it nests too deeply"
    elif isinstance(exc, MemoryError):
        detail = "it ran out of memory"
    else:
        detail = f"{type(exc).__name__}: {_short(str(exc))[1:-1]}"
    return ChatTemplateError(f"the model's chat template failed: {detail}")


# -- the bounds of one render ------------------------------------------------------------------


class _Abort(BaseException):
    """Ends a render from anywhere inside it: a BaseException, so that no ``except Exception``
    in Jinja2's own code (the ``int`` filter, constant folding) can swallow it and carry on."""


@dataclass(slots=True)
class _Budget:
    limit: int  # units one value, or the whole output, may hold
    work: int  # units the values still to be made may add up to
    deadline: float  # time.monotonic() when the work must end
    # False while compiling: a refusal then raises an Exception, which makes Jinja2's
    # constant folding leave the expression to run time (where it may never run)
    strict: bool = True
    depth: int = 0
    tracer: _TraceFunction | None = None  # made on first use by _traced
    previous_tracer: _TraceFunction | None = None  # the thread's, when the render began
    # id -> (container, its _text_size): containers the template made, so that measuring a
    # new one built from them does not go through them again
    sizes: dict[int, tuple[object, int]] = field(default_factory=dict)

    def refuse(self, why: str) -> NoReturn:
        if self.strict:
            raise _Abort(why)
        raise ChatTemplateError(f"the model's chat template failed: {why}")

    def over(self, units: int, what: str) -> None:
        if units > self.limit:
            self.refuse(f"{what} would hold {units:,} units, over the limit of {self.limit:,}")

    def ints(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Integer arguments are widths, counts or lengths: none may pass the limit."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > self.limit:
                self.refuse(f"an argument of {value:,} is over the limit of {self.limit:,}")

    def made(self, value: _T) -> _T:
        """``value``, made by the template: checked against the limits and charged."""
        if type(value) is str:
            units = len(value)
        elif isinstance(value, _CONTAINERS):
            units = max(_units(value), _CONTAINER_UNITS)
            self.over(units, "a value")
            self.measure(value)
        else:
            if isinstance(value, int) and value.bit_length() > INT_LIMIT_BITS:
                self.refuse(f"an integer of {value.bit_length():,} bits is over {INT_LIMIT_BITS}")
            if isinstance(value, GeneratorType):
                return _charged(value, self)  # type: ignore[return-value]
            units = _units(value)
        if units > self.limit:
            self.over(units, "a value")
        self.work -= units
        if self.work < 0:
            self.refuse("the values it made add up to more than the limit allows")
        return value

    def measure(self, container: object) -> None:
        """Refuses a container whose text, nested parts included (a part held twice counts
        twice), passes the limit: C code that compares, hashes or prints it goes through all
        of that, out of reach of the deadline."""
        size = _text_size(container, self.limit)
        self.over(size, "a nested value")
        if size >= _CACHED_ABOVE:
            self.sizes[id(container)] = (container, size)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            self.refuse(f"it ran longer than {RENDER_DEADLINE_S:g} s")


def _charged(items: Iterator[Any], budget: _Budget) -> Iterator[Any]:
    for item in items:
        budget.tick()
        yield budget.made(item)


def _current() -> _Budget:
    budget: _Budget | None = getattr(_local, "budget", None)
    if budget is None:  # not inside render_chat: the default bounds, no deadline
        return _Budget(OUTPUT_LIMIT_CHARS, WORK_FACTOR * OUTPUT_LIMIT_CHARS, float("inf"), False)
    return budget


def _units(value: object) -> int:
    if type(value) is str or isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return _ITEM_UNITS * len(value)
    if isinstance(value, (dict, Set)):
        return _ENTRY_UNITS * len(value)
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


def _text_size(value: object, stop: int, indent: int = 0) -> int:
    """About how many characters ``str(value)`` (or JSON of it, with ``indent`` more per level
    of nesting on each line) has, containers counted in full (a part held twice counts twice);
    counting ends past ``stop``."""
    kind = type(value)
    if kind is str:
        return len(value) + 2  # type: ignore[arg-type]
    if kind in _SCALARS:
        return _SCALARS[kind](value)
    return _walk(value, stop, indent)


def _walk(value: object, stop: int, indent: int) -> int:
    """_text_size of a container: without recursion, so any depth of nesting is fine."""
    budget, namespace = _current(), _environment().globals["namespace"]
    known = {} if indent else budget.sizes
    total, pending = 0, [(value, 1)]
    while pending and total <= stop:
        budget.tick()
        item, depth = pending.pop()
        if isinstance(item, namespace):
            item = object.__getattribute__(item, "_Namespace__attrs")
        if isinstance(item, (str, bytes, bytearray)):
            total += len(item) + 2
            continue
        if isinstance(item, Mapping):
            children: Any = (*item.keys(), *item.values())
        elif isinstance(item, (list, tuple, Set, _DictView)):
            children = item
        else:
            total += 64
            continue
        total += 2 + len(item) * (4 + depth * indent)
        for child in children:
            kind = type(child)
            if kind is str:
                total += len(child) + 2
            elif kind in _SCALARS:
                total += _SCALARS[kind](child)
            else:
                hit = known.get(id(child))
                if hit is not None and hit[0] is child:
                    total += hit[1]
                else:
                    pending.append((child, depth + 1))
            if total > stop:
                break
    return total


_SCALARS: dict[type, Callable[[Any], int]] = {
    int: lambda n: n.bit_length() // 3 + 2,
    bool: lambda _: 5,
    float: lambda _: 24,
    type(None): lambda _: 4,
}
_DictView = (type({}.keys()), type({}.values()), type({}.items()))


def _messages_size(messages: list[dict[str, Any]]) -> int:
    """Characters in the messages: their text, and any other fields they carry."""
    size = 0
    for message in messages:
        size += len(message["role"]) + len(message["content"])
        if len(message) > 2:
            extra = [v for k, v in message.items() if k not in ("role", "content")]
            size += _text_size(extra, sys.maxsize)
    return size


def _short(value: object) -> str:
    if isinstance(value, str):
        return repr(value if len(value) <= 200 else value[:200] + "...")
    return reprlib.repr(value)


# -- time: a trace function with a deadline -----------------------------------------------------


class _Guard:
    """Makes ``budget`` this thread's budget for one render. On the way out, error or not,
    the thread's trace function is put back as it was (see _traced)."""

    def __init__(self, budget: _Budget) -> None:
        self.budget = budget
        self.saved: _Budget | None = None

    def __enter__(self) -> None:
        self.budget.previous_tracer = sys.gettrace()
        self.saved = getattr(_local, "budget", None)
        _local.budget = self.budget

    def __exit__(self, *exc_info: object) -> None:
        sys.settrace(self.budget.previous_tracer)
        _local.budget = self.saved


def _traced(budget: _Budget, func: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``func(*args, **kwargs)`` with the budget's deadline tracer installed: for library code
    (the compiler, filters) whose loops the budget's own checks do not reach."""
    previous = sys.gettrace()
    if budget.tracer is None:
        budget.tracer = _deadline_tracer(budget.deadline, budget.previous_tracer)
    elif previous is budget.tracer:
        return func(*args, **kwargs)
    sys.settrace(budget.tracer)
    try:
        return func(*args, **kwargs)
    finally:
        sys.settrace(previous)


def _deadline_tracer(deadline: float, previous: _TraceFunction | None) -> _TraceFunction:
    """A trace function that raises _Abort at the first call or line past ``deadline``. A
    tracer that was already installed (a debugger's, coverage's) still gets its events."""
    clock, late = time.monotonic, f"it ran longer than {RENDER_DEADLINE_S:g} s"

    def on_line(frame: FrameType, event: str, arg: Any) -> Any:
        if clock() > deadline:
            raise _Abort(late)
        return on_line

    def on_call_chained(frame: FrameType, event: str, arg: Any) -> Any:
        if clock() > deadline:
            raise _Abort(late)
        theirs = previous(frame, event, arg) if previous is not None else None
        if sys.gettrace() is not on_call_chained:  # C tracers re-install themselves on calls
            sys.settrace(on_call_chained)
        return on_line if theirs is None else _chained(theirs, on_line)

    return on_line if previous is None else on_call_chained


def _chained(theirs: _TraceFunction, ours: _TraceFunction) -> _TraceFunction:
    def both(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal theirs
        ours(frame, event, arg)
        if theirs is not None:
            theirs = theirs(frame, event, arg)
        return both

    return both


# -- size: guards for the steps that can grow a value in one go ---------------------------------


def _binop_size(op: str, left: Any, right: Any) -> int:
    """Units the result of ``left op right`` would hold; 0 where it is bounded anyway."""
    if op == "+":
        return _units(left) + _units(right) if type(left) is type(right) else 0
    if op == "*":
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int) and isinstance(seq, (str, bytes, list, tuple)):
            return _units(seq) * max(times, 0)
    elif op == "%" and isinstance(left, str):
        values = tuple(right.values()) if isinstance(right, dict) else right
        return _percent_size(left, values if isinstance(values, tuple) else (values,))
    return 0


def _power_bits(base: Any, exponent: Any) -> int:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        return (abs(base).bit_length() - 1) * exponent
    return 0


def _spec_width(spec: str) -> int:
    """The largest number written in a format spec (a width or a precision)."""
    digits = "".join(c if c.isdigit() else " " for c in spec).split()
    return max((int(d) if len(d) < 20 else sys.maxsize for d in digits), default=0)


_PERCENT_SPEC = re.compile(r"%(\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.?)")


def _percent_size(fmt: str, values: tuple[Any, ...]) -> int:
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


def _format_size(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
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
    stop = _current().limit
    return max((_text_size(v, stop) for v in values), default=0)


def _replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(text, (str, bytes)) and type(old) is type(text) is type(new)):
        return 0
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def _join_size(separator: Any, items: list[Any]) -> int:
    total, stop = len(separator) * len(items), _current().limit
    for item in items:
        total += _text_size(item, stop)
        if total > stop:
            break
    return total


def _as_text(budget: _Budget, value: object, what: str) -> str:
    """``str(value)``, once its size is known to be within the limit."""
    if not isinstance(value, str):
        budget.over(_text_size(value, budget.limit), what)
    return str(value)


def _guard_text_method(
    budget: _Budget, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Checks a call of a str or bytes method; ``join``'s iterable comes back as a list."""
    text, name = method.__self__, method.__name__
    if name == "replace" and len(args) >= 2:
        budget.over(_replace_size(text, *args[:3]), "replace()")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        tab = "\t" if isinstance(text, str) else b"\t"
        if isinstance(tabsize, int):
            budget.over(len(text) + text.count(tab) * tabsize, "expandtabs()")
    elif name == "join" and len(args) == 1:
        args = (list(args[0]),)
        budget.over(_join_size(text, args[0]), "join()")
    elif name == "translate" and args and isinstance(text, str):
        budget.over(len(text) * max(1, _text_size(args[0], budget.limit)), "translate()")
    return args


def _guard_call(
    budget: _Budget, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
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
            budget.over(_format_size(inner.__self__, args, named), f"{func.__name__}()")
    return args


def _guard_filter(
    name: str, budget: _Budget, head: tuple[Any, ...], args: list[Any], kwargs: dict[str, Any]
) -> int:
    """Checks a filter call before it runs; returns about how many units it will go through.
    ``args[0]`` is the filtered value; ``head`` holds the context or environment the filter
    asked for. ``join`` and ``sum`` get their value as a list, so that the check does not use
    up an iterator."""
    if name in _SIZE_ARGUMENTS:
        budget.ints(args[1:], kwargs)
    value = args[0]
    if name in _STRINGIFYING_FILTERS:
        size = _text_size(value, budget.limit) * _SLOW_FILTERS.get(name, 1)
        budget.over(size, f"the {name} filter")
        return size
    if name == "join":
        args[0] = list(value)
        separator = _as_text(budget, args[1] if len(args) > 1 else kwargs.get("d", ""), name)
        budget.over(_join_size(separator, args[0]), "the join filter")
    elif name == "replace" and len(args) >= 3:
        text = _as_text(budget, value, "the replace filter")
        budget.over(_replace_size(text, *args[1:4]), "the replace filter")
    elif name == "format":
        text = _as_text(budget, value, "the format filter")
        budget.over(_percent_size(text, (*args[1:], *kwargs.values())), "the format filter")
    elif name == "indent":
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        lines = value.count("\n") + 1 if isinstance(value, str) else 1
        size = _text_size(value, budget.limit) + lines * _width(width)
        budget.over(size, "the indent filter")
    elif name == "tojson":
        indent = _width(args[1] if len(args) > 1 else kwargs.get("indent"))
        budget.over(_text_size(value, budget.limit, indent), "the tojson filter")
    elif name == "sum":
        _numbers_only(budget, head, args, kwargs)
    return len(value) if isinstance(value, range) else _units(args[0])


# filters whose integer arguments are widths or counts of what they make
_SIZE_ARGUMENTS = frozenset(
    {"batch", "center", "indent", "slice", "tojson", "truncate", "urlize", "wordwrap"}
)
_TRACE_ABOVE = 4096  # units: library code going through fewer ends soon without a tracer
# Filters whose C code is slow per character (textwrap's regular expression: about 1 s per
# MB): their input counts this many times against the limit.
_SLOW_FILTERS = {"wordwrap": 8}


_STRINGIFYING_FILTERS = frozenset(
    "capitalize center e escape forceescape lower pprint safe string striptags title trim "
    "truncate upper urlencode urlize wordcount wordwrap xmlattr".split()
)


def _width(width: object) -> int:
    """An indent given as a number of spaces or as a string (``indent``, ``tojson``)."""
    if isinstance(width, str):
        return len(width)
    return max(width, 0) if isinstance(width, int) else 0


def _numbers_only(
    budget: _Budget, head: tuple[Any, ...], args: list[Any], kwargs: dict[str, Any]
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


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    passes_first = getattr(func, "jinja_pass_arg", None) is not None  # context/environment

    @wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _current()
        head, rest = (args[:1], list(args[1:])) if passes_first else ((), list(args))
        if rest and _guard_filter(name, budget, head, rest, kwargs) > _TRACE_ABOVE:
            return budget.made(_traced(budget, func, *head, *rest, **kwargs))
        return budget.made(func(*head, *rest, **kwargs))

    return bounded


def _each(items: Any) -> Iterator[Any]:
    """What every ``{% for %}`` iterates: each step resumes this generator, a call the
    deadline's trace function sees, and ticks the budget."""
    budget = _current()
    for item in items:
        budget.tick()
        yield item


# -- the environment ----------------------------------------------------------------------------


def _raise_exception(message: object) -> NoReturn:
    text = message if isinstance(message, str) else reprlib.repr(message)
    raise ChatTemplateError(f"the model's chat template refused the messages: {text[:500]}")


def _strftime_now(fmt: str) -> str:
    if isinstance(fmt, str):
        _current().over(12 * len(fmt), "strftime_now()")  # %c: 2 characters make 24
    return datetime.datetime.now().strftime(fmt)


def _finalize(value: Any) -> Any:
    """Each ``{{ value }}`` before it becomes text: str() of a container can be huge."""
    if type(value) is not str:
        budget = _current()
        budget.over(_text_size(value, budget.limit), "an output value")
    return value


@lru_cache(maxsize=1)
def _environment() -> Any:
    from jinja2 import nodes, pass_context
    from jinja2.compiler import CodeGenerator, Frame
    from jinja2.runtime import LoopContext, Macro, markup_join, str_join
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
            for loop in node.find_all(nodes.For):  # iterate each loop through _each
                loop.iter = nodes.Filter(loop.iter, _EACH, [], [], None, None)
                loop.iter.set_lineno(loop.lineno).set_environment(self.environment)
            super().visit_Template(node, frame)

        def visit_List(self, node: nodes.List, frame: Frame) -> None:
            self.literal(super().visit_List, node, frame)

        def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
            self.literal(super().visit_Tuple, node, frame)

        def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
            self.literal(super().visit_Dict, node, frame)

        def literal(self, visit: Callable[[Any, Frame], None], node: Any, frame: Frame) -> None:
            """``[a, b]``, ``(a, b)``, ``{a: b}`` through the environment: may hold the same big
            value twice. Constants and assignment targets need not."""
            if getattr(node, "ctx", "load") == "store":
                return visit(node, frame)
            try:
                node.as_const(frame.eval_ctx)
                return visit(node, frame)
            except nodes.Impossible:
                pass
            self.write("environment.literal(")
            visit(node, frame)
            self.write(")")
            return None

        def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
            """``a ~ b`` through the environment, which checks the size first."""
            self.write("environment.join_values((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            markup = "context.eval_ctx.volatile" if frame.eval_ctx.volatile else "False"
            self.write(f"), {'True' if frame.eval_ctx.autoescape else markup})")

        def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
            """``a[i:j]`` through the environment too (Jinja2 lets slices bypass it)."""
            if not isinstance(node.arg, nodes.Slice):
                return super().visit_Getitem(node, frame)
            self.write("environment.getslice(")
            self.visit(node.node, frame)
            self.write(", slice(")
            for part in (node.arg.start, node.arg.stop, node.arg.step):
                self.visit(part, frame) if part is not None else self.write("None")
                self.write(", ")
            self.write("))")
            return None

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _current()
            if operator == "+" and type(left) is str and type(right) is str:  # the usual
                budget.over(len(left) + len(right), "'+'")
                return budget.made(left + right)
            if operator in ("+", "*", "%"):
                budget.over(_binop_size(operator, left, right), repr(operator))
            elif operator == "**" and _power_bits(left, right) > INT_LIMIT_BITS:
                budget.refuse(f"{left} ** {right} has more than {INT_LIMIT_BITS} bits")
            return budget.made(self.binop_table[operator](left, right))

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            budget = _current()
            budget.tick()
            budget.depth += 1
            try:
                if budget.depth > CALL_DEPTH_LIMIT:
                    budget.refuse(f"its calls nest deeper than {CALL_DEPTH_LIMIT}")
                if isinstance(obj, (Macro, LoopContext)):  # template code: checked as it runs
                    return budget.made(super().call(context, obj, *args, **kwargs))
                args = _guard_call(budget, obj, args, kwargs)
                call = super().call
                if type(obj) is BuiltinMethodType or isinstance(obj, type):  # C code
                    return budget.made(call(context, obj, *args, **kwargs))
                return budget.made(_traced(budget, call, context, obj, *args, **kwargs))
            finally:
                budget.depth -= 1

        @staticmethod
        def literal(value: Any) -> Any:
            return _current().made(value)

        @staticmethod
        def getslice(obj: Any, where: slice) -> Any:
            return _current().made(obj[where])

        @staticmethod
        def concat(pieces: Any) -> str:  # macro and block bodies, {% set %}...{% endset %}
            pieces = pieces if isinstance(pieces, list) else list(pieces)
            budget = _current()
            budget.over(sum(map(len, pieces)), "a macro or block")
            return budget.made("".join(pieces))

        @staticmethod
        def join_values(values: tuple[Any, ...], markup: bool) -> str:
            budget = _current()
            budget.over(sum(_text_size(v, budget.limit) for v in values), "'~'")
            return budget.made((markup_join if markup else str_join)(values))

    env = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        finalize=_finalize,
    )
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_EACH] = pass_context(lambda _context, items: _each(items))  # never folded
    env.globals.pop("lipsum", None)  # pages of random text: no chat template needs it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    """The compiled template (the compiler runs with the deadline's tracer: it is library
    code, and the source may be huge)."""
    return _traced(_current(), _environment().from_string, source)
