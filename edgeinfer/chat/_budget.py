"""The bounds on one render of an untrusted chat template (see template): its budget of
time, size and work, the trace function that enforces the deadline inside library code, and
how big a value is.

Sizes are in units: a character, ``_ITEM_UNITS`` per list or tuple item, ``_ENTRY_UNITS`` per
dict or set entry.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from functools import lru_cache
from types import FrameType, GeneratorType
from typing import Any, NoReturn, TypeVar

from ..errors import ChatTemplateError

_ITEM_UNITS = 8  # a list or tuple item: one pointer
_ENTRY_UNITS = 32  # a dict or set entry: hash, key and value
CONTAINERS = (list, tuple, dict, set, frozenset)
_CONTAINER_UNITS = 64  # what a container made by the template costs at least
_CACHED_ABOVE = 256  # text size from which a made container's size is remembered
_DEFAULT_LIMIT = 4 * 2**20  # outside a render (nothing should get there)

_T = TypeVar("_T")
TraceFunction = Callable[[FrameType, str, Any], Any]
_local = threading.local()


class Abort(BaseException):
    """Ends a render from anywhere inside it: a BaseException, so that no ``except Exception``
    in Jinja2's own code (the ``int`` filter, constant folding) can swallow it and carry on."""


@dataclass(slots=True)
class Budget:
    limit: int  # units one value, or the whole output, may hold
    work: int  # units the values still to be made may add up to
    deadline: float  # time.monotonic() when the work must end
    seconds: float  # how long the work had, for messages
    int_bits: int  # bits an integer may have
    max_depth: int  # how deep calls may nest
    # False while compiling: a refusal then raises an Exception, which makes Jinja2's
    # constant folding leave the expression to run time (where it may never run)
    strict: bool = True
    depth: int = 0
    tracer: TraceFunction | None = None  # made on first use by traced
    previous_tracer: TraceFunction | None = None  # the thread's, when the render began
    rearm: TraceFunction | None = None  # the profile function that re-arms the tracer
    watching: int = 0  # traced() calls running: the tracer may re-arm itself
    # id -> (container, its text_size): containers the template made, so that measuring a
    # new one built from them does not go through them again
    sizes: dict[int, tuple[object, int]] = field(default_factory=dict)

    def refuse(self, why: str) -> NoReturn:
        if self.strict:
            raise Abort(why)
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
        elif isinstance(value, CONTAINERS):
            units = max(units_of(value), _CONTAINER_UNITS)
            self.over(units, "a value")
            self.measure(value)
        else:
            if isinstance(value, int) and value.bit_length() > self.int_bits:
                self.refuse(f"an integer of {value.bit_length():,} bits is over {self.int_bits}")
            if isinstance(value, GeneratorType):
                return charged(value, self)  # type: ignore[return-value]
            units = units_of(value)
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
        size = text_size(container, self.limit)
        self.over(size, "a nested value")
        if size >= _CACHED_ABOVE:
            self.sizes[id(container)] = (container, size)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            self.refuse(f"it ran longer than {self.seconds:g} s")


def charged(items: Iterator[Any], budget: Budget) -> Iterator[Any]:
    for item in items:
        budget.tick()
        yield budget.made(item)


def current() -> Budget:
    budget: Budget | None = getattr(_local, "budget", None)
    if budget is None:  # not inside render_chat: the default bounds, no deadline
        endless = float("inf")
        limit = _DEFAULT_LIMIT
        return Budget(limit, 16 * limit, endless, endless, 4096, 64, strict=False)
    return budget


def units_of(value: object) -> int:
    if type(value) is str or isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return _ITEM_UNITS * len(value)
    if isinstance(value, (dict, Set)):
        return _ENTRY_UNITS * len(value)
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


def text_size(value: object, stop: int, indent: int = 0) -> int:
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
    """text_size of a container: without recursion, so any depth of nesting is fine."""
    budget, namespace = current(), _namespace_type()
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


@lru_cache(maxsize=1)
def _namespace_type() -> type:
    from jinja2.runtime import Namespace

    return Namespace


def messages_size(messages: list[dict[str, Any]]) -> int:
    """Characters in the messages: their text, and any other fields they carry."""
    size = 0
    for message in messages:
        size += len(message["role"]) + len(message["content"])
        if len(message) > 2:
            extra = [v for k, v in message.items() if k not in ("role", "content")]
            size += text_size(extra, sys.maxsize)
    return size


class Guard:
    """Makes ``budget`` this thread's budget for one render. On the way out, error or not,
    the thread's trace function is put back as it was (see traced)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.saved: Budget | None = None

    def __enter__(self) -> None:
        self.budget.previous_tracer = sys.gettrace()
        self.saved = getattr(_local, "budget", None)
        _local.budget = self.budget

    def __exit__(self, *exc_info: object) -> None:
        _local.budget = self.saved
        if self.budget.rearm is not None and sys.getprofile() is self.budget.rearm:
            sys.setprofile(None)  # traced() removes it: a net, as below
        if sys.gettrace() is not self.budget.previous_tracer:  # traced() restores it: a net
            sys.settrace(self.budget.previous_tracer)


def traced(budget: Budget, func: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``func(*args, **kwargs)`` with the budget's deadline tracer installed: for library code
    (the compiler, filters) whose loops the budget's own checks do not reach."""
    previous = sys.gettrace()
    if budget.tracer is None:
        budget.tracer = _deadline_tracer(budget, budget.previous_tracer)
    elif previous is budget.tracer:
        return func(*args, **kwargs)
    sys.settrace(budget.tracer)
    budget.watching += 1
    try:
        result = func(*args, **kwargs)
    finally:
        budget.watching -= 1
        if not budget.watching and sys.getprofile() is budget.rearm:  # see _deadline_tracer
            sys.setprofile(None)
        sys.settrace(previous)
    # CPython drops a trace function once it raises: when the tracer's Abort went into a
    # frame that swallowed it (a generator closed by the garbage collector, a finalizer),
    # the work ran on unwatched; it must not count as done in time.
    budget.tick()
    return result


def _deadline_tracer(budget: Budget, previous: TraceFunction | None) -> TraceFunction:
    """A trace function that raises Abort at the first call or line, past the budget's
    deadline, of code a template can run. A finalizer or GC callback that happens to run then
    is left alone; a tracer that was already installed (a debugger's, coverage's) still gets
    its events.

    CPython drops a trace function once it raises. Where a frame swallows the Abort (a
    generator closed by the garbage collector, a finalizer), the work would run on unwatched:
    so the first Abort inside traced() also installs a profile function that puts the tracer
    back at the next Python call, and the Abort comes again from there. Not where a profiler
    is installed (cProfile's, a caller's): that is left alone, and work that swallowed the
    Abort then runs to its end before traced() counts it late; so does a frame that swallows
    it and then makes no Python call."""
    clock, deadline = time.monotonic, budget.deadline
    late = f"it ran longer than {budget.seconds:g} s"

    def on_line(frame: FrameType, event: str, arg: Any) -> Any:
        if clock() > deadline and _template_code(frame):
            if budget.watching and sys.getprofile() is None:
                sys.setprofile(rearm)
            raise Abort(late)
        return on_line

    def rearm(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and sys.gettrace() is None:
            sys.settrace(top)

    def on_call_chained(frame: FrameType, event: str, arg: Any) -> Any:
        on_line(frame, event, arg)
        theirs = previous(frame, event, arg) if previous is not None else None
        if sys.gettrace() is not on_call_chained:  # C tracers re-install themselves on calls
            sys.settrace(on_call_chained)
        return on_line if theirs is None else _chained(theirs, on_line)

    top = on_line if previous is None else on_call_chained
    budget.rearm = rearm
    return top


def _template_code(frame: FrameType) -> bool:
    """Whether ``frame`` runs the template, Jinja2, or library code its filters call."""
    if frame.f_code.co_filename == "<template>":
        return True
    module = frame.f_globals.get("__name__")
    return isinstance(module, str) and module.partition(".")[0] in _TEMPLATE_MODULES


_TEMPLATE_MODULES = frozenset(
    "edgeinfer jinja2 markupsafe textwrap json pprint re string html urllib reprlib random "
    "collections functools itertools operator datetime".split()
)


def _chained(theirs: TraceFunction, ours: TraceFunction) -> TraceFunction:
    def both(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal theirs
        ours(frame, event, arg)
        if theirs is not None:
            theirs = theirs(frame, event, arg)
        return both

    return both
