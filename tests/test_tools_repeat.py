"""A forced reply's calls are bounded and never repeat: a greedy model that has made its call
tends to write it again and again until the length limit (the default model did, under
``tool_choice="required"`` with parallel calls allowed)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from edgeinfer.generation import Chunk, TokenStream
from edgeinfer.model import Model
from edgeinfer.structured import compile_constraint
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
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


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


def scripted(pieces: list[str], finish: str = "stop") -> tuple[ToolCallStream, threading.Event]:
    chunks = [Chunk(p, (i,)) for i, p in enumerate(pieces)]
    chunks.append(Chunk("", (), finish, STATS))  # type: ignore[arg-type]
    cancel = threading.Event()
    inner = TokenStream(iter(chunks), cancel)
    return ToolCallStream(inner, check_tools(TOOLS), FORMATS["generic"]), cancel


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
