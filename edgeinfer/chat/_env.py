"""The Jinja2 sandbox for chat templates, with the hooks that keep a render within its budget.

Every step that can make a value goes through the environment: operators (``call_binop``),
calls, filters, ``~``, slices, list/tuple/dict literals, macro and block bodies (``concat``)
and ``{{ output }}`` (``finalize``); every ``{% for %}`` iterates through ``_each``. Imported on
the first render only, so that ``import edgeinfer`` does not load Jinja2.
"""

from __future__ import annotations

import datetime
import reprlib
from collections.abc import Callable, Iterator
from functools import wraps
from types import BuiltinMethodType
from typing import Any, NoReturn

from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import LoopContext, Macro, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError
from ._budget import current, text_size, traced
from ._guards import TRACE_ABOVE, binop_size, guard_call, guard_filter, power_bits

_EACH = "edgeinfer_each"  # the filter every {% for %} iterates through


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    passes_first = getattr(func, "jinja_pass_arg", None) is not None  # context/environment

    @wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        head, rest = (args[:1], list(args[1:])) if passes_first else ((), list(args))
        if rest and guard_filter(name, budget, head, rest, kwargs) > TRACE_ABOVE:
            return budget.made(traced(budget, func, *head, *rest, **kwargs))
        return budget.made(func(*head, *rest, **kwargs))

    return bounded


def _each(items: Any) -> Iterator[Any]:
    """What every ``{% for %}`` iterates: each step resumes this generator, a call the
    deadline's trace function sees, and ticks the budget."""
    budget = current()
    for item in items:
        budget.tick()
        yield item


def raise_exception(message: object) -> NoReturn:
    text = message if isinstance(message, str) else reprlib.repr(message)
    raise ChatTemplateError(f"the model's chat template refused the messages: {text[:500]}")


def _strftime_now(fmt: str) -> str:
    if isinstance(fmt, str):
        current().over(12 * len(fmt), "strftime_now()")  # %c: 2 characters make 24
    return datetime.datetime.now().strftime(fmt)


def _finalize(value: Any) -> Any:
    """Each ``{{ value }}`` before it becomes text: str() of a container can be huge."""
    if type(value) is not str:
        budget = current()
        budget.over(text_size(value, budget.limit), "an output value")
    return value


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
        budget = current()
        if operator == "+" and type(left) is str and type(right) is str:  # the usual
            budget.over(len(left) + len(right), "'+'")
            return budget.made(left + right)
        if operator in ("+", "*", "%"):
            budget.over(binop_size(operator, left, right), repr(operator))
        elif operator == "**" and power_bits(left, right) > budget.int_bits:
            budget.refuse(f"{left} ** {right} has more than {budget.int_bits} bits")
        return budget.made(self.binop_table[operator](left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.tick()
        budget.depth += 1
        try:
            if budget.depth > budget.max_depth:
                budget.refuse(f"its calls nest deeper than {budget.max_depth}")
            if isinstance(obj, (Macro, LoopContext)):  # template code: checked as it runs
                return budget.made(super().call(context, obj, *args, **kwargs))
            args = guard_call(budget, obj, args, kwargs)
            call = super().call
            if type(obj) is BuiltinMethodType or isinstance(obj, type):  # C code
                return budget.made(call(context, obj, *args, **kwargs))
            return budget.made(traced(budget, call, context, obj, *args, **kwargs))
        finally:
            budget.depth -= 1

    @staticmethod
    def literal(value: Any) -> Any:
        return current().made(value)

    @staticmethod
    def getslice(obj: Any, where: slice) -> Any:
        return current().made(obj[where])

    @staticmethod
    def concat(pieces: Any) -> str:  # macro and block bodies, {% set %}...{% endset %}
        pieces = pieces if isinstance(pieces, list) else list(pieces)
        budget = current()
        budget.over(sum(map(len, pieces)), "a macro or block")
        return budget.made("".join(pieces))

    @staticmethod
    def join_values(values: tuple[Any, ...], markup: bool) -> str:
        budget = current()
        budget.over(sum(text_size(v, budget.limit) for v in values), "'~'")
        return budget.made((markup_join if markup else str_join)(values))


def make_environment() -> BoundedEnvironment:
    """The sandbox every chat template runs in (one per process: see template._environment)."""
    env = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        finalize=_finalize,
    )
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_EACH] = pass_context(lambda _context, items: _each(items))  # never folded
    env.globals.pop("lipsum", None)  # pages of random text: no chat template needs it
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
