"""Property tests: random templates and random messages end in a string within the bounds, or in
a ChatTemplateError / InvalidRequestError — never another exception, never past the deadline.

``EDGEINFER_FUZZ_EXAMPLES`` sets how many cases each test runs (default below)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edgeinfer import ChatTemplateError, InvalidRequestError
from edgeinfer.chat import template as chat_template
from edgeinfer.chat.template import render_chat, validate_messages

EXAMPLES = int(os.environ.get("EDGEINFER_FUZZ_EXAMPLES", "250"))
DEADLINE_S = 0.25  # the render deadline while fuzzing, so that cases that hit it stay cheap
LIMIT_CHARS = 64 * 1024  # the output limit while fuzzing
SLACK_S = 1.0
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <|im_start|> {{ x }}"},
    {"role": "assistant", "content": "<think>hm</think>Hello"},
]
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # each case checks its own time against the render deadline
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- a grammar of template fragments ------------------------------------------------------------

INTS = st.one_of(
    st.integers(-3, 12),
    st.sampled_from([0, 1, 2, 4096, 10**5, 10**6, 4 * 2**20, 10**9, 10**18, -(10**9)]),
    st.integers(-(10**30), 10**30),
)
TEXTS = st.text(alphabet="ab <>{}%*\n\t'\"\\", max_size=5).map(repr)
LEAVES = st.one_of(
    INTS.map(str),
    TEXTS,
    st.sampled_from(
        [
            "messages",
            "messages[0].content",
            "messages[1]['role']",
            "messages[-1].content",
            "messages.nothing",
            "messages[0].nothing()",
            "ns.s",
            "ns.l",
            "ns.n",
            "bos_token",
            "none",
            "add_generation_prompt",
            "range(3)",
            "[1, 2, 3]",
            "{'a': 1}",
            "1.5",
            "m",
            "loop.index",
        ]
    ),
)
BINOPS = ["+", "-", "*", "/", "//", "%", "**", "~", "==", "<", "in", "and", "or"]
FILTERS = [
    "upper",
    "trim",
    "length",
    "string",
    "list",
    "first",
    "last",
    "reverse",
    "sort",
    "unique",
    "sum",
    "int",
    "tojson",
    "e",
    "default('d')",
    "replace('a', 'aaaa')",
    "replace('', 'xy')",
    "center({n})",
    "indent({n})",
    "truncate({n})",
    "wordwrap({n})",
    "batch({n}, 'f')",
    "slice({n})",
    "join('{t}')",
    "format({n})",
    "tojson(indent={n})",
    "map('string')",
    "map('upper')",
    "select",
    "selectattr('role', 'equalto', 'user')",
    "map(attribute='content')",
    "groupby('role')",
    "dictsort",
    "items",
    "pprint",
    "striptags",
    "urlize",
    "xmlattr",
]
METHODS = [
    "center({n})",
    "ljust({n}, '*')",
    "zfill({n})",
    "replace('a', 'aaaa')",
    "replace('', '{t}')",
    "expandtabs({n})",
    "split('a')",
    "strip()",
    "upper()",
    "format({n}, {n})",
    "join(['a', 'b', 'c'])",
    "startswith('a')",
    "items()",
    "count('a')",
    "to_bytes({n}, 'big')",
]


def _filled(pattern: str, n: int, text: str) -> str:
    return pattern.replace("{n}", str(n)).replace("'{t}'", text)


@st.composite
def expressions(draw: st.DrawFn, depth: int = 0) -> str:
    if depth >= 3 or draw(st.integers(0, 3)) == 0:
        return draw(LEAVES)
    kind = draw(st.sampled_from(["binop", "filter", "method", "call", "list", "slice", "paren"]))
    inner = draw(expressions(depth + 1))
    n, text = draw(INTS), draw(TEXTS)
    if kind == "binop":
        return f"({inner} {draw(st.sampled_from(BINOPS))} {draw(expressions(depth + 1))})"
    if kind == "filter":
        return f"({inner}|{_filled(draw(st.sampled_from(FILTERS)), n, text)})"
    if kind == "method":
        return f"({inner}).{_filled(draw(st.sampled_from(METHODS)), n, text)}"
    if kind == "call":
        name = draw(st.sampled_from(["f", "g", "range", "raise_exception", "namespace", "dict"]))
        return f"{name}({inner})"
    if kind == "list":
        return f"[{inner}, {draw(expressions(depth + 1))}, {inner}]"
    if kind == "slice":
        return f"({inner})[{draw(INTS)}:{draw(INTS)}]"
    return f"({inner})"


@st.composite
def statements(draw: st.DrawFn, depth: int = 0) -> str:
    kinds = ["output", "output", "set"] + (["for", "for_messages", "if"] if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    expression = draw(expressions())
    if kind == "output":
        return "{{ " + expression + " }}"
    if kind == "set":
        target = draw(st.sampled_from(["ns.s", "ns.l", "ns.n", "x"]))
        return "{% set " + target + " = " + expression + " %}"
    body = "".join(draw(st.lists(statements(depth + 1), min_size=1, max_size=3)))
    if kind == "for":
        stop = draw(st.sampled_from(["3", "99999", "10**9", expression]))
        control = draw(st.sampled_from(["", "", "{% break %}", "{% continue %}"]))
        return "{% for i in range(" + stop + ") %}" + body + control + "{% endfor %}"
    if kind == "for_messages":
        return "{% for m in messages %}" + body + "{% endfor %}"
    return "{% if " + expression + " %}" + body + "{% else %}{{ 1 }}{% endif %}"


MACROS = (
    "{% set ns = namespace(s='ab', l=[1, 2], n=2) %}"
    "{% macro f(n) %}{% if n is number and n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
    "{{ n }}{% endmacro %}"
    "{% macro g(x) %}{{ g(x) }}{% endmacro %}"
)


@st.composite
def templates(draw: st.DrawFn) -> str:
    body = "".join(draw(st.lists(statements(), min_size=1, max_size=4)))
    return (MACROS if draw(st.booleans()) else "") + body


@FUZZ
@given(templates())
def test_random_templates_end_in_a_bounded_string_or_a_chat_template_error(source: str) -> None:
    tracer = sys.gettrace()
    limit = LIMIT_CHARS + 4 * sum(len(m["role"]) + len(m["content"]) for m in MESSAGES)
    with (
        mock.patch.object(chat_template, "RENDER_DEADLINE_S", DEADLINE_S),
        mock.patch.object(chat_template, "OUTPUT_LIMIT_CHARS", LIMIT_CHARS),
    ):
        started, started_cpu = time.monotonic(), time.thread_time()
        try:
            text = render_chat(source, MESSAGES, bos_token="<s>", eos_token="</s>")
        except ChatTemplateError as exc:
            assert str(exc).startswith(("the model's chat template", "this model"))
            event(_kind(str(exc)))
        else:
            assert isinstance(text, str) and len(text) <= limit
            event("rendered")
        # wall time, unless this thread was not even running (a loaded machine): CPU time
        elapsed = min(time.monotonic() - started, time.thread_time() - started_cpu)
    assert elapsed <= DEADLINE_S + SLACK_S, f"{elapsed:.2f} s"
    assert sys.gettrace() is tracer


def _kind(message: str) -> str:
    """The kind of failure, for hypothesis' statistics: the words before any figure or quote."""
    words = message.split(": ", 1)[-1].split()
    kind = [w for w in words[:6] if not any(c.isdigit() or c in "'\"" for c in w)]
    return "error: " + " ".join(kind[:4])


# -- random messages ------------------------------------------------------------------------------

JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)
ROLES = st.one_of(
    st.sampled_from(["system", "user", "assistant", "tool"]),
    st.text(max_size=8),
    JSONISH,
)
CONTENTS = st.one_of(
    st.text(),
    st.sampled_from(["", "x" * 3_000_000, "<|im_start|>system\n", "{{ 7 * 7 }}", "\ud800"]),
    JSONISH,
)


@st.composite
def messages_like(draw: st.DrawFn) -> Any:
    message = st.one_of(
        st.fixed_dictionaries(
            {"role": ROLES, "content": CONTENTS},
            optional={"name": JSONISH, "tool_calls": JSONISH, "extra": JSONISH},
        ),
        st.fixed_dictionaries({"content": CONTENTS}),
        JSONISH,
    )
    items = draw(st.lists(message, max_size=4))
    return draw(
        st.sampled_from(
            [items, tuple(items), iter(items), {"messages": items}, "hello", b"hi", None, 3]
        )
    )


@FUZZ
@given(messages_like())
def test_random_messages_are_accepted_or_an_invalid_request(messages: Any) -> None:
    try:
        checked = validate_messages(messages)
    except InvalidRequestError:
        return
    assert all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in checked)
    for template in ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}",
                     "{{ messages|tojson }}{{ messages }}"):  # fmt: skip
        try:
            text = render_chat(template, messages, bos_token=None, eos_token=None)
        except ChatTemplateError:
            continue
        assert isinstance(text, str)
