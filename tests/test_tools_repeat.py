"""A forced reply's calls are bounded and never repeat: a greedy model that has made its call
tends to write it again and again until the length limit (the default model did, under
``tool_choice="required"`` with parallel calls allowed)."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.generation.results import Chunk, TokenStream
from edgeinfer.generation.structured import compile_constraint
from edgeinfer.model import Model
from edgeinfer.tools import check_tool_choice, check_tools
from edgeinfer.tools.formats import FORMATS, MAX_PARALLEL_CALLS
from edgeinfer.tools.stream import ToolCallStream

from .fakes import EOS, FakeTokenizer
from .test_tools import ASK, STATS, TOOLS, assert_valid, fake
from .tool_templates import CHATML

pytest.importorskip("llguidance")

PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
PING_CALL = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'


def keys(calls: Any) -> list[tuple[str, str]]:
    """Each call's name and its arguments as canonical JSON (keys sorted): two calls with the
    same arguments written in another key order have the same key."""
    return [(c["function"]["name"], _canonical(c["function"]["arguments"])) for c in calls]


def _canonical(arguments: str) -> str:
    return json.dumps(json.loads(arguments), sort_keys=True)


def test_the_forcing_grammar_ends_after_any_call_and_holds_at_most_the_bound() -> None:
    tools = check_tools([PING])
    grammar = FORMATS["generic"].grammar(tools, check_tool_choice("required", tools), True)
    constraint = compile_constraint({"type": "grammar", "lark": grammar}, FakeTokenizer())
    for n in range(1, MAX_PARALLEL_CALLS + 1):
        if n > 1:
            constraint.accept(ord("\n"))
        for byte in PING_CALL.encode():
            constraint.accept(byte)
        assert constraint.accepting  # the reply may end after every complete call
    allowed = constraint.allowed() if not constraint.complete else None
    # after the bound, nothing but the end: no separator towards one more call
    assert allowed is None or (not allowed[ord("\n")] and allowed[EOS])


def scripted(
    pieces: list[str], finish: str = "stop", tools: Any = TOOLS, fmt: str = "generic"
) -> tuple[ToolCallStream, threading.Event]:
    chunks = [Chunk(p, (i,)) for i, p in enumerate(pieces)]
    chunks.append(Chunk("", (), finish, STATS))  # type: ignore[arg-type]
    cancel = threading.Event()
    inner = TokenStream(iter(chunks), cancel)
    return ToolCallStream(inner, check_tools(tools), FORMATS[fmt]), cancel


def test_a_repeated_call_ends_the_reply_and_is_dropped() -> None:
    oslo, lima = WEATHER_CALL % "Oslo", WEATHER_CALL % "Lima"
    stream, cancel = scripted([oslo, "\n", lima, "\n", oslo[:20], oslo[20:], "\n<tool_", "ca"])
    chunks = list(stream)
    assert stream.result is not None and cancel.is_set()  # generation was asked to stop
    assert stream.result.finish_reason == "tool_calls" and stream.result.tool_call_error is None
    cities = [json.loads(c["function"]["arguments"])["city"] for c in stream.result.tool_calls]
    assert cities == ["Oslo", "Lima"]
    assert [c for chunk in chunks for c in chunk.tool_calls] == list(stream.result.tool_calls)
    assert "".join(chunk.text for chunk in chunks) == ""  # nothing after the repeat leaks


NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}
OSLO_2 = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
OSLO_2_AGAIN = '{"arguments": {"days":2,  "city":"\\u004fslo"}, "name": "get_weather"}'


def test_the_same_arguments_in_another_key_order_are_a_repeat() -> None:
    """Keys in another order, other spacing, a character escaped: the same call."""
    assert json.loads(OSLO_2_AGAIN) == json.loads(OSLO_2) and OSLO_2_AGAIN != OSLO_2
    lima = WEATHER_CALL % "Lima"
    pieces = [f"<tool_call>{OSLO_2}</tool_call>", "\n", lima, "\n"]
    stream, cancel = scripted([*pieces, f"<tool_call>{OSLO_2_AGAIN}</tool_call>", "\n", lima])
    result = stream.collect()
    assert cancel.is_set() and result.finish_reason == "tool_calls"
    assert result.tool_call_error is None
    assert [json.loads(c["function"]["arguments"]) for c in result.tool_calls] == [
        {"city": "Oslo", "days": 2},
        {"city": "Lima"},
    ]


def test_a_whole_reply_block_drops_a_reordered_repeat() -> None:
    """Mistral's one block of calls: the second, reordered, copy of the first is dropped."""
    stream, _ = scripted([f"[TOOL_CALLS][{OSLO_2}, ", f"{OSLO_2_AGAIN}]"], fmt="mistral")
    result = stream.collect()
    assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1
    assert json.loads(result.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}


json_leaves = st.none() | st.booleans() | st.integers(-9, 9) | st.text(max_size=4)
json_objects = st.recursive(
    st.dictionaries(st.text(max_size=3), json_leaves, max_size=4),
    lambda inner: st.dictionaries(
        st.text(max_size=3), inner | st.lists(inner, max_size=3), max_size=4
    ),
    max_leaves=12,
)


def _shuffled(value: Any, rng: random.Random) -> Any:
    """``value`` with the keys of every object in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@settings(max_examples=150, deadline=None)
@given(json_objects, json_objects, st.integers(0, 2**32 - 1), st.booleans())
def test_any_arguments_repeat_whatever_their_key_order(
    first: dict[str, Any], second: dict[str, Any], seed: int, ascii_only: bool
) -> None:
    """Two different calls, then the first again with its keys shuffled at every level and
    written another way: the reply holds the two and ends there."""
    rng = random.Random(seed)

    def call(arguments: dict[str, Any]) -> str:
        body = {"name": "note", "arguments": arguments}
        text = json.dumps(body, ensure_ascii=ascii_only, indent=rng.choice([None, 1]))
        return f"<tool_call>{text}</tool_call>"

    pieces = [call(first), call(second), call(_shuffled(first, rng)), call(second)]
    stream, cancel = scripted(pieces, tools=[NOTE])
    result = stream.collect()
    want = [first] if first == second else [first, second]
    assert [json.loads(c["function"]["arguments"]) for c in result.tool_calls] == want
    assert cancel.is_set() and result.finish_reason == "tool_calls"


def test_a_length_ending_keeps_its_complete_calls_and_reports_the_cut_one() -> None:
    oslo, lima = WEATHER_CALL % "Oslo", WEATHER_CALL % "Lima"
    stream, cancel = scripted([oslo, "\n", lima, "\n", lima[:25]], finish="length")
    result = stream.collect()
    assert not cancel.is_set()
    assert result.finish_reason == "length" and len(result.tool_calls) == 2
    assert result.tool_call_error  # the cut call, reported
    assert lima[:25] in result.text  # and its text is there, never passed on as a call


@pytest.mark.parametrize("seed", range(4))
def test_required_with_parallel_calls_never_repeats_a_call(seed: int) -> None:
    model = fake(CHATML)
    for tools in ([PING], [*TOOLS, PING]):
        result = model.chat(ASK, tools=tools, tool_choice="required", seed=seed,
                            max_new_tokens=1500)  # fmt: skip
        assert result.finish_reason == "tool_calls", (result.text, result.tool_call_error)
        assert 1 <= len(result.tool_calls) <= MAX_PARALLEL_CALLS
        assert len(set(keys(result.tool_calls))) == len(result.tool_calls)
        for call in result.tool_calls:
            assert_valid(call, [*TOOLS, PING])


@pytest.mark.model
def test_default_model_required_with_parallel_calls_ends_in_calls(default_model: Model) -> None:
    questions = [
        "What's the weather in Oslo for the next 2 days?",
        "What time is it in Paris (CET)?",
        "Is it raining in Lima?",
    ]
    for question in questions:
        messages = [{"role": "user", "content": question}]
        result = default_model.chat(
            messages, tools=TOOLS, tool_choice="required", temperature=0, max_new_tokens=256
        )
        assert result.finish_reason == "tool_calls", (question, result.text)
        assert result.tool_call_error is None
        assert len(set(keys(result.tool_calls))) == len(result.tool_calls) >= 1
        for call in result.tool_calls:
            assert_valid(call)
