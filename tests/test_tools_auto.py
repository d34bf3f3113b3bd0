"""tool_choice="auto" made to call (issue 39 item 1): call markers the tokenizer holds as
tokens, tool-result markers that end a reply (the echo), the grammar that holds auto's calls
to their schemas, and the one retry with a forced choice.

Fast tests run on scripted streams, the fake backend (byte vocabulary) and a tiny random
GGUF whose vocabulary holds ``<tool_call>`` as a user-defined token (as Qwen 2.5's does);
the catalog's Qwen2.5-Coder 0.5B test is marked ``model``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.generation.results import Chunk, TokenStream
from edgeinfer.generation.structured import compile_constraint
from edgeinfer.model import Model
from edgeinfer.tools import check_tools, detect_format
from edgeinfer.tools.formats import FORMATS
from edgeinfer.tools.markers import RESULT_MARKERS, Markers, ReplyText, find_markers
from edgeinfer.tools.retry import CALL, TEXT, RetryPlan, answered_calls
from edgeinfer.tools.run import tool_chat
from edgeinfer.tools.stream import ToolCallStream

from .fakes import VOCAB, FakeTokenizer
from .test_tools import ASK, STATS, TOOLS, assert_valid, fake
from .tool_templates import CHATML, HERMES, LLAMA3

pytest.importorskip("llguidance")

OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
ECHO = "<tool_response>\nSunny, 22 C\n</tool_response>"


def chunks_of(pieces: list[str], finish: str = "stop", ids: list[int] | None = None) -> TokenStream:
    ids = ids if ids is not None else list(range(len(pieces)))
    chunks = [Chunk(p, (i,)) for p, i in zip(pieces, ids, strict=True)]
    chunks.append(Chunk("", (), finish, STATS))  # type: ignore[arg-type]
    return TokenStream(iter(chunks), threading.Event())


def over(pieces: list[str], fmt: str = "generic", **kw: Any) -> ToolCallStream:
    return ToolCallStream(chunks_of(pieces), check_tools(TOOLS), FORMATS[fmt], **kw)


def cut_into(text: str, cuts: list[int]) -> list[str]:
    pieces = []
    while text:
        n = cuts[len(pieces) % len(cuts)]
        pieces.append(text[:n])
        text = text[n:]
    return pieces


# -- the echo: a tool-result marker ends the reply -------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    st.text(st.characters(blacklist_characters="<"), max_size=40),
    st.sampled_from(["<tool_response>", '<tool_response name="get_weather">', "</tool_response>"]),
    st.text(max_size=40),
    st.lists(st.integers(1, 7), min_size=1, max_size=20),
    st.sampled_from(["generic", "hermes"]),
)
def test_a_reply_ends_before_a_tool_result_marker_however_it_is_cut(
    before: str, marker: str, after: str, cuts: list[int], fmt: str
) -> None:
    stream = over(cut_into(before + marker + after, cuts), fmt, cut=RESULT_MARKERS)
    chunks = list(stream)
    result = stream.result
    assert result is not None and stream.cut_at is not None
    assert result.text == before.rstrip() == "".join(c.text for c in chunks)
    assert "tool_response" not in result.text
    assert result.finish_reason == "stop" and result.tool_calls == ()


def test_the_echoed_wrapper_is_no_answer_and_a_call_before_it_stands() -> None:
    stream = over([ECHO[:9], ECHO[9:]], cut=RESULT_MARKERS)
    echoed = stream.collect()
    assert echoed.text == "" and echoed.finish_reason == "stop"
    assert echoed.tool_call_error is not None and "tool result" in echoed.tool_call_error
    answered = over(["Sunny. ", ECHO], cut=RESULT_MARKERS).collect()
    assert answered.text == "Sunny." and answered.tool_call_error is None
    rerun = Rerun(["It is sunny in Oslo."])  # the retry asks an echo again for text
    result = over([" ", ECHO], cut=RESULT_MARKERS, retry=RetryPlan(rerun)).collect()
    assert rerun.asked == [(TEXT, None)] and result.text == "It is sunny in Oslo."
    assert result.tool_call_error is None
    stream = over([f"<tool_call>{OSLO}</tool_call>", "\n", ECHO], cut=RESULT_MARKERS)
    result = stream.collect()
    assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1
    assert result.text == ""


def test_templates_that_write_result_markers_get_them_as_the_cut() -> None:
    def reply(template: str, pattern: str) -> str:
        forced = {"type": "regex", "pattern": pattern}
        return fake(template).chat(ASK, tools=TOOLS, tool_choice="none", max_new_tokens=40,
                                   response_format=forced).text  # fmt: skip

    assert reply(HERMES, "Sunny\\.\\n<tool_response>x") == "Sunny."
    assert reply(CHATML, "Sunny <tool_response>x") == "Sunny"  # the generic format's own
    assert reply(LLAMA3, "ok <tool_response>") == "ok <tool_response>"  # results are turns


def test_after_a_tool_result_the_reply_never_holds_the_markers() -> None:
    """The whole loop on the fake model with the Hermes/Qwen-style template: the reply to a
    tool result is read through the cut whatever the model writes."""
    model = fake(HERMES)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    loop = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 C"}]  # fmt: skip
    assert "<tool_response>\nSunny, 22 C\n</tool_response>" in model.apply_chat_template(
        model_messages(loop), tools=TOOLS
    )
    forced = {"type": "regex", "pattern": "Sunny, 22 C\\n</tool_response>\\n<tool_response>"}
    for seed in range(4):
        echo = model.chat(loop, tools=TOOLS, seed=seed, max_new_tokens=60, response_format=forced)
        assert echo.text == "Sunny, 22 C"
        free = tool_chat(model, loop, tools=TOOLS, seed=seed, max_new_tokens=40)
        assert not any(m in free.text for m in RESULT_MARKERS)


def model_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from edgeinfer.chat import validate_messages

    return validate_messages(messages)


# -- call markers the tokenizer holds as tokens ----------------------------------------------


class MarkerTokenizer(FakeTokenizer):
    """The fake byte vocabulary with <tool_call> and </tool_call> as textless tokens."""

    OPEN, CLOSE = VOCAB, VOCAB + 1

    @property
    def n_vocab(self) -> int:
        return VOCAB + 2

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        if parse_special and text in ("<tool_call>", "</tool_call>"):
            return [self.OPEN if text == "<tool_call>" else self.CLOSE]
        return super().encode(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id in (self.OPEN, self.CLOSE) else super().token_bytes(token_id)


def test_marker_tokens_are_found_only_where_they_render_as_nothing() -> None:
    tokenizer = MarkerTokenizer()
    markers = find_markers(tokenizer, FORMATS["hermes"], HERMES)
    assert dict(markers.tokens) == {VOCAB: "<tool_call>", VOCAB + 1: "</tool_call>"}
    assert markers.cut == RESULT_MARKERS
    assert find_markers(FakeTokenizer(), FORMATS["hermes"], HERMES).tokens == {}
    assert find_markers(tokenizer, FORMATS["llama3"], None).cut == ()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=12))
def test_a_call_between_marker_tokens_is_found(cuts: list[int]) -> None:
    """The reply as the engine streams it: the marker tokens' chunks hold no text."""
    open_, close = MarkerTokenizer.OPEN, MarkerTokenizer.CLOSE
    pieces = ["", *cut_into("\n" + OSLO + "\n", cuts), ""]
    ids = [open_, *range(len(pieces) - 2), close]  # a text piece's id: its index

    def token_bytes(i: int) -> bytes:
        return b"" if i in (open_, close) else pieces[i + 1].encode()

    markers = Markers({open_: "<tool_call>", close: "</tool_call>"}, RESULT_MARKERS)
    stream = ToolCallStream(chunks_of(pieces, ids=ids), check_tools(TOOLS), FORMATS["hermes"],
                            reply=ReplyText(token_bytes, markers), cut=markers.cut)  # fmt: skip
    result = stream.collect()
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert [c["function"]["arguments"] for c in result.tool_calls] == ['{"city":"Oslo"}']
    blind = ToolCallStream(chunks_of(pieces, ids=ids), check_tools(TOOLS), FORMATS["hermes"])
    assert blind.collect().tool_calls == ()  # read as text alone, the tags are gone


def test_the_auto_grammar_names_the_marker_token() -> None:
    tools = check_tools(TOOLS)
    grammar = FORMATS["hermes"].auto_grammar(tools, False, {"<tool_call>": VOCAB})
    assert f"<[{VOCAB}]>" in grammar
    constraint = compile_constraint({"type": "grammar", "lark": grammar}, MarkerTokenizer())
    allowed = constraint.allowed()
    assert allowed[VOCAB] and not allowed[VOCAB + 1]  # a call opens with the model's token


# -- grammar-constrained auto -----------------------------------------------------------------


def _accepts(grammar: str, text: str) -> bool:
    constraint = compile_constraint({"type": "grammar", "lark": grammar}, FakeTokenizer())
    for byte in text.encode():
        if not constraint.allowed()[byte]:
            return False
        constraint.accept(byte)
    return constraint.accepting


@pytest.mark.parametrize(
    ("reply", "ok"),
    [
        ("Paris is sunny, I think.", True),
        (f"<tool_call>{OSLO}</tool_call>", True),
        (f"Let me look.\n<tool_call>{OSLO}</tool_call>", True),
        (f"<tool_call>{OSLO}</tool_call>\n<tool_call>{OSLO}</tool_call>", True),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', False),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', False),
        ("<tool_call>{not json}</tool_call>", False),
        (f"<tool_call>{OSLO}</tool_call> and more text", False),
    ],
)
def test_auto_grammar_allows_text_or_valid_calls(reply: str, ok: bool) -> None:
    grammar = FORMATS["generic"].auto_grammar(check_tools(TOOLS), True)
    assert _accepts(grammar, reply) is ok


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**16))
def test_under_auto_grammar_a_reply_is_text_or_valid_calls(seed: int) -> None:
    model = fake(CHATML)
    result = tool_chat(model, ASK, tools=TOOLS, auto="grammar", retry=False, seed=seed,
                       max_new_tokens=200, temperature=1.5)  # fmt: skip
    for call in result.tool_calls:
        assert_valid(call)
    if result.finish_reason != "length":
        assert result.tool_call_error is None
        assert result.tool_calls or "<tool_call>" not in result.text


def test_auto_grammar_steps_aside_for_stop_strings_and_response_formats() -> None:
    from edgeinfer.generation.sampling import SamplingConfig
    from edgeinfer.tools import ToolRequest

    request = ToolRequest.build(TOOLS, "auto", None, CHATML)
    assert request is not None
    from dataclasses import replace

    grammar = replace(request, auto="grammar")
    assert grammar.constrains_auto(SamplingConfig())
    assert not grammar.constrains_auto(SamplingConfig(stop=("END",)))
    assert not grammar.constrains_auto(SamplingConfig(response_format={"type": "json_object"}))
    assert not request.constrains_auto(SamplingConfig())


# -- the retry ---------------------------------------------------------------------------------


class Rerun:
    """A RetryPlan's rerun that hands out scripted second replies and counts its calls."""

    def __init__(self, *replies: list[str]) -> None:
        self.replies = list(replies)
        self.asked: list[tuple[str, str | None]] = []

    def __call__(self, kind: str, name: str | None) -> tuple[TokenStream, ReplyText]:
        self.asked.append((kind, name))
        return chunks_of(self.replies.pop(0)), ReplyText()


BAD = ['<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>']
GOOD = [f"<tool_call>{OSLO}</tool_call>"]


@pytest.mark.parametrize(
    ("first", "asked"),
    [
        (BAD, (CALL, "get_weather")),  # arguments off the schema
        (["<tool_call>{not json", "}</tool_call>"], (CALL, None)),  # malformed, no name
        (["<tool_call>"], (CALL, None)),  # the bare preamble of a call
        (['<tool_call>{"name": "get_time", "argu'], (CALL, "get_time")),  # cut
        (["```json\n", OSLO[:20], OSLO[20:], "\n```"], (CALL, "get_weather")),  # outside
        (["Sure:\n{{", OSLO[1:], "}"], (CALL, "get_weather")),
    ],
)
def test_a_failed_call_is_asked_again_once_with_the_call_forced(
    first: list[str], asked: tuple[str, str | None]
) -> None:
    rerun = Rerun(GOOD)
    stream = over(first, retry=RetryPlan(rerun))
    chunks = list(stream)
    result = stream.result
    assert result is not None and rerun.asked == [asked] and stream.retried == CALL
    assert result.finish_reason == "tool_calls" and result.tool_call_error is None
    assert [c["function"]["arguments"] for c in result.tool_calls] == ['{"city":"Oslo"}']
    assert result.text == "".join(c.text for c in chunks)
    assert "Rome" not in result.text and "{" not in result.text  # the failure never shows
    assert result.stats.completion_tokens == 2 * STATS.completion_tokens


def test_the_retry_is_bounded_a_second_failure_is_reported() -> None:
    rerun = Rerun(BAD, GOOD)
    result = over(BAD, retry=RetryPlan(rerun)).collect()
    assert len(rerun.asked) == 1  # never a third try
    assert result.tool_calls == () and result.finish_reason == "stop"
    assert result.tool_call_error is not None and "city" in result.tool_call_error
    assert result.text == BAD[0]


def test_no_retry_without_a_failure_or_without_the_plan() -> None:
    rerun = Rerun(GOOD)
    for reply in (["It is sunny."], GOOD, ["```python\nprint(1)\n```"], ['{"a": 1}']):
        assert over(reply, retry=RetryPlan(rerun)).collect().tool_call_error is None
    assert rerun.asked == []
    plain = over(BAD).collect()  # no plan: reported as before
    assert plain.tool_call_error and plain.text == BAD[0]
    outside = over(["```json\n" + OSLO + "\n```"]).collect()
    assert outside.text == "```json\n" + OSLO + "\n```" and outside.tool_call_error is None


def test_a_repeat_of_the_answered_call_is_asked_again_for_text() -> None:
    answered = answered_calls(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny", "name": "get_weather"},
        ]
    )  # fmt: skip
    assert answered == {("get_weather", '{"city": "Oslo"}')}
    for first in (GOOD, ["```json\n" + OSLO + "\n```"]):
        rerun = Rerun(["It is sunny in Oslo."])
        stream = over(first, retry=RetryPlan(rerun, answered))
        result = stream.collect()
        assert rerun.asked == [(TEXT, None)] and stream.retried == TEXT
        assert result.text == "It is sunny in Oslo." and result.tool_calls == ()
    lima = '{"name": "get_weather", "arguments": {"city": "Lima"}}'
    restated = Rerun(["It is sunny in Oslo."])  # the same function, outside the format
    over(["```json\n" + lima + "\n```"], retry=RetryPlan(restated, answered)).collect()
    assert restated.asked == [(TEXT, None)]
    other = Rerun(GOOD)  # a new call in the format is a call
    result = over([f"<tool_call>{lima}</tool_call>"], retry=RetryPlan(other, answered)).collect()
    assert other.asked == [] and len(result.tool_calls) == 1
    time = '{"name": "get_time", "arguments": {"zone": "CET"}}'
    forced = Rerun(GOOD)  # another function outside the format: the call forced
    over(["```json\n" + time + "\n```"], retry=RetryPlan(forced, answered)).collect()
    assert forced.asked == [(CALL, "get_time")]


class Counted(Model):
    """The fake model, whose first reply is scripted (a malformed call)."""

    first: list[str] = BAD

    def _stream(self, ids: list[int], cfg: Any, keep: int, wait: bool, **kw: Any) -> TokenStream:
        self.streams = getattr(self, "streams", 0) + 1
        if self.streams == 1:
            return chunks_of(self.first)
        return super()._stream(ids, cfg, keep, wait, **kw)


def test_the_runner_retries_through_the_model_under_a_forced_grammar() -> None:
    from .fakes import FakeBackend

    model = Counted(FakeBackend(n_ctx=4096), name="fake", path=Path("fake"), model_format="f")
    model.use_chat_template(CHATML)
    stream = tool_chat(model, ASK, tools=TOOLS, retry=True, auto="plain", seed=3,
                       max_new_tokens=300, stream=True)  # fmt: skip
    result = stream.collect()
    assert model.streams == 2 and stream.retried == CALL
    if result.finish_reason == "tool_calls":
        assert {c["function"]["name"] for c in result.tool_calls} == {"get_weather"}  # named
        for call in result.tool_calls:
            assert_valid(call)
    else:  # the forced call ran out of tokens: reported, never handed out
        assert result.finish_reason == "length" and result.tool_call_error


def test_tool_chat_refuses_unknown_settings() -> None:
    from edgeinfer.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="auto="):
        tool_chat(fake(CHATML), ASK, tools=TOOLS, auto="sometimes")
    with pytest.raises(InvalidRequestError, match="retry="):
        tool_chat(fake(CHATML), ASK, tools=TOOLS, retry="yes")  # type: ignore[arg-type]


# -- a tiny GGUF whose vocabulary holds <tool_call> as a token ---------------------------------


@pytest.fixture(scope="module")
def marker_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from . import ggufgen as g

    model = g.tiny_llama()
    tokens = list(model.metadata["tokenizer.ggml.tokens"].value[1])
    types = list(model.metadata["tokenizer.ggml.token_type"].value[1])
    model.metadata["tokenizer.ggml.tokens"] = g.Value(
        g.ARRAY, (g.STRING, [*tokens, "<tool_call>", "</tool_call>"])
    )
    model.metadata["tokenizer.ggml.token_type"] = g.Value(g.ARRAY, (g.I32, [*types, 4, 4]))
    embd = model.tensors[0]
    model.tensors[0] = g.reshaped(embd, (embd.shape[0], len(tokens) + 2))
    return model.write(tmp_path_factory.mktemp("marker") / "marker.gguf")


@pytest.fixture(scope="module")
def marker_model(marker_gguf: Path) -> Iterator[Model]:
    pytest.importorskip("llama_cpp")
    import edgeinfer

    model = edgeinfer.load(marker_gguf, context_length=256, threads=1)
    model.use_chat_template(TINY_HERMES_TOOLS)
    yield model
    model.close()


TINY_HERMES_TOOLS = (
    "{% if tools %}<tool_call>{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
    "<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.role }}:{{ m.content }}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)
TINY_TOOL = {"type": "function", "function": {"name": "t", "parameters": {
    "type": "object", "properties": {"z": {"enum": ["UTC", "CET"]}}, "required": ["z"],
    "additionalProperties": False}}}  # fmt: skip


def test_a_tiny_model_calls_with_its_own_marker_tokens(marker_model: Model) -> None:
    assert detect_format(marker_model.chat_template).name == "hermes"
    tokenizer = marker_model._tokenizer
    markers = find_markers(tokenizer, FORMATS["hermes"], marker_model.chat_template)
    ids = {text: i for i, text in markers.tokens.items()}
    assert set(ids) == {"<tool_call>", "</tool_call>"}
    ask = [{"role": "user", "content": "Time?"}]
    bias = {ids["<tool_call>"]: 60.0, ids["</tool_call>"]: 60.0}  # the model's own tokens
    result = tool_chat(marker_model, ask, tools=[TINY_TOOL], tool_choice="required", seed=1,
                       parallel_tool_calls=False, max_new_tokens=60, logit_bias=bias)  # fmt: skip
    assert result.finish_reason == "tool_calls", (result.text, result.tool_call_error)
    assert ids["<tool_call>"] in result.token_ids and ids["</tool_call>"] in result.token_ids
    assert_valid(result.tool_calls[0], [TINY_TOOL]) and result.text == ""


# -- Qwen2.5-Coder 0.5B, the catalog model ----------------------------------------------------


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip


@pytest.mark.model
def test_qwen_coder_makes_a_valid_weather_call_under_the_default_auto() -> None:
    from edgeinfer.files.catalog import is_present, lookup

    entry = lookup("qwen2.5-coder-0.5b-instruct")
    if entry is None or not is_present(entry):
        pytest.skip("qwen2.5-coder-0.5b-instruct is not in EDGEINFER_HOME")
    import edgeinfer

    with edgeinfer.load(entry.name, engine="llama.cpp", threads=2, context_length=2048) as model:
        ask = [{"role": "user", "content": "What's the weather in Oslo?"}]
        result = tool_chat(model, ask, tools=[WEATHER], tool_choice="auto", temperature=0,
                           max_new_tokens=128)  # fmt: skip
        assert result.finish_reason == "tool_calls", (result.text, result.tool_call_error)
        assert_valid(result.tool_calls[0], [WEATHER])
        arguments = json.loads(result.tool_calls[0]["function"]["arguments"])
        assert result.tool_calls[0]["function"]["name"] == "get_weather"
        assert "oslo" in arguments["city"].lower()


# -- hostile replies: the readers of a model's text never fail ---------------------------------

PIECES = st.sampled_from(
    ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "```json\n", "```",
     "{", "}", "{{", '"name"', ": ", '"get_weather"', '"get_time"', '"arguments"', '{"city": ',
     '"Oslo"', '"Rome"', "\\", '"', "\n", " ", "text", "é", "🙂"]
)  # fmt: skip
NAMES = frozenset({"get_weather", "get_time"})


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES | st.text(max_size=4), max_size=14).map("".join), st.text(max_size=12))
def test_the_preamble_reader_is_total_and_never_takes_back_its_answer(text: str, more: str) -> None:
    from edgeinfer.tools import preamble

    state, name = preamble.match(text, NAMES)
    later, later_name = preamble.match(text + more, NAMES)
    if state == preamble.NO:
        assert later == preamble.NO
    if state == preamble.YES:
        assert (later, later_name) == (preamble.YES, name) and name in NAMES
    at, found, _ = preamble.find(text, NAMES)
    assert (at == -1) == (found == preamble.NO) and -1 <= at < max(len(text), 1)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(PIECES | st.text(max_size=3), max_size=16),
    st.sampled_from(["generic", "hermes"]),
    st.booleans(),
)
def test_any_reply_is_read_without_failing_and_retried_at_most_once(
    pieces: list[str], fmt: str, answered: bool
) -> None:
    rerun = Rerun(GOOD, GOOD)
    keys = frozenset({("get_weather", '{"city": "Oslo"}')}) if answered else frozenset()
    stream = over(pieces, fmt, cut=RESULT_MARKERS, retry=RetryPlan(rerun, keys))
    chunks = list(stream)
    result = stream.result
    assert result is not None and len(rerun.asked) <= 1
    assert result.text == "".join(c.text for c in chunks)
    if result.tool_call_error is None:  # a failed call's text is kept as it was
        assert not any(m in result.text for m in RESULT_MARKERS)
    for call in result.tool_calls:
        assert_valid(call)
    if result.tool_calls:
        assert [c for chunk in chunks for c in chunk.tool_calls] == list(result.tool_calls)


def test_model_chat_with_tools_is_the_tool_chat(marker_model: Model) -> None:
    """Model.chat given tools runs tools.run.tool_chat: marker tokens read, the retry on."""
    from .fakes import FakeBackend

    model = Counted(FakeBackend(n_ctx=4096), name="fake", path=Path("fake"), model_format="f")
    model.use_chat_template(CHATML)
    model.chat(ASK, tools=TOOLS, seed=3, max_new_tokens=300)
    assert model.streams == 2  # the malformed first reply was asked again
    markers = find_markers(marker_model._tokenizer, FORMATS["hermes"], "")
    ids = {text: i for i, text in markers.tokens.items()}
    bias = {ids["<tool_call>"]: 60.0, ids["</tool_call>"]: 60.0}
    result = marker_model.chat([{"role": "user", "content": "Time?"}], tools=[TINY_TOOL],
                               tool_choice="required", parallel_tool_calls=False, seed=1,
                               max_new_tokens=60, logit_bias=bias)  # fmt: skip
    assert result.finish_reason == "tool_calls" and ids["<tool_call>"] in result.token_ids
