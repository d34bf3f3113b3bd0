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

import reprlib
import time
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any, TypeVar

from ..errors import ChatTemplateError, InvalidRequestError
from ._budget import Abort, Budget, Guard, current, messages_size, traced
from ._slots import Marks, RenderedChat, align
from .tool_messages import ToolTurns

__all__ = [
    "CALL_DEPTH_LIMIT",
    "INT_LIMIT_BITS",
    "OUTPUT_LIMIT_CHARS",
    "OUTPUT_LIMIT_PER_MESSAGE_CHAR",
    "RENDER_DEADLINE_S",
    "WORK_FACTOR",
    "RenderedChat",
    "render_chat",
    "render_chat_pieces",
    "validate_messages",
]

RENDER_DEADLINE_S = 2.0  # wall-clock seconds for compiling and rendering one prompt
OUTPUT_LIMIT_CHARS = 4 * 2**20  # units any one value, or the output, may hold ...
OUTPUT_LIMIT_PER_MESSAGE_CHAR = 4  # ... plus this many per character of the messages
WORK_FACTOR = 16  # all values made in one render: at most this many times the limit
INT_LIMIT_BITS = 4096
CALL_DEPTH_LIMIT = 64
_EACH = "edgeinfer_each"  # the filter every {% for %} iterates through
_ROLES = frozenset({"system", "user", "assistant", "tool"})
_T = TypeVar("_T")


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts; each needs a known role and string content. An assistant
    message may carry ``tool_calls`` (then its content may be None) and a ``tool`` message
    must answer one of them by ``tool_call_id`` (see tool_messages)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
        )
    checked = []
    turns = ToolTurns()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] is {type(message).__name__}, not a dict")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}]['role']={_short(role)}; expected one of {sorted(_ROLES)}"
            )
        if role == "assistant" and message.get("tool_calls") is not None:
            checked.append(turns.assistant(message, f"messages[{i}]"))
            continue
        if role == "tool":
            checked.append(turns.tool(message, f"messages[{i}]"))
            continue
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
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for ``messages``, as the model was trained to see it; ``tools`` (in
    OpenAI's shape) reach the template as its ``tools`` variable, as Hugging Face's do."""
    source = _source(template)
    context = _context(validate_messages(messages), tools, bos_token, eos_token)
    return _render(source, context, add_generation_prompt)


def render_chat_pieces(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> RenderedChat:
    """``render_chat``'s text, with what of it the template wrote and where the caller's
    strings lie, found by construction (see _slots): the template renders a second time
    with a sentinel in place of each string of the messages and tools."""
    source = _source(template)
    checked = validate_messages(messages)
    context = _context(checked, tools, bos_token, eos_token)
    text = _render(source, context, add_generation_prompt)
    marks = Marks(f"{source}{bos_token}{eos_token}", checked, tools)
    if not marks.values:  # nothing the caller wrote can spell markup
        return RenderedChat(text, text, ((text, False),) if text else (), ())
    stand_ins = _context(marks.mark(checked), marks.mark(tools), bos_token, eos_token)
    try:
        skeleton = _render(source, stand_ins, add_generation_prompt)
    except ChatTemplateError:  # the template refused the stand-ins
        return RenderedChat(text, None, None, tuple(marks.values))
    pieces = align(text, skeleton, marks, _ENCODERS)
    return RenderedChat(text, skeleton, pieces, tuple(marks.values))


def _source(template: str | None) -> str:
    if not template:
        raise ChatTemplateError(
            "this model has no chat template; use generate()/stream() with a plain prompt"
        )
    if not isinstance(template, str):
        raise ChatTemplateError(f"the model's chat template is a {type(template).__name__}")
    return template


def _context(
    messages: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    bos_token: str | None,
    eos_token: str | None,
) -> dict[str, Any]:
    context: dict[str, Any] = {
        "messages": messages,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
    }
    if tools:
        context["tools"] = [dict(t) for t in tools]
    return context


def _render(template: str, context: dict[str, Any], add_generation_prompt: bool) -> str:
    """One render of ``template`` within the bounds (time, size, memory) of module doc."""
    tools = context.get("tools")
    size = messages_size(context["messages"]) + (
        messages_size([{"role": "", "content": "", "t": tools}]) if tools else 0
    )
    limit = OUTPUT_LIMIT_CHARS + OUTPUT_LIMIT_PER_MESSAGE_CHAR * size
    deadline = time.monotonic() + RENDER_DEADLINE_S
    budget = Budget(
        limit, WORK_FACTOR * limit, deadline, RENDER_DEADLINE_S, INT_LIMIT_BITS, CALL_DEPTH_LIMIT
    )
    context = {**context, "add_generation_prompt": add_generation_prompt}
    return _bounded(budget, lambda: _compile_and_render(template, context, budget))


def _json_text(value: str) -> str:
    """What the sandbox's ``tojson`` writes of a string inside its quotes."""
    from jinja2.utils import htmlsafe_json_dumps

    policies = _environment().policies
    dumps = policies["json.dumps_function"]
    return htmlsafe_json_dumps(value, dumps=dumps, **policies["json.dumps_kwargs"])[1:-1]


def _html_text(value: str) -> str:
    from markupsafe import escape

    return str(escape(value))


def _python_text(value: str) -> str:
    """A string as ``str()`` of a list or dict holding it writes it, inside single quotes."""
    text = repr(value)
    return text[1:-1] if text[0] == "'" else value  # in double quotes: no reading


_ENCODERS = (_json_text, _html_text, _python_text)


def _compile_and_render(template: str, context: dict[str, Any], budget: Budget) -> str:
    budget.strict = False  # see Budget.strict
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


def _bounded(budget: Budget, work: Callable[[], _T]) -> _T:
    """``work()`` within ``budget``; whatever goes wrong becomes a ChatTemplateError."""
    try:
        with Guard(budget):
            return work()
    except ChatTemplateError:
        raise
    except Abort as exc:  # not chained: its frames hold the big values it refused
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


def _short(value: object) -> str:
    if isinstance(value, str):
        return repr(value if len(value) <= 200 else value[:200] + "...")
    return reprlib.repr(value)


@lru_cache(maxsize=1)
def _environment() -> Any:
    from ._env import make_environment

    return make_environment()


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    """The compiled template (the compiler runs with the deadline's tracer: it is library
    code, and the source may be huge)."""
    return traced(current(), _environment().from_string, source)
