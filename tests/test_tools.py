"""Tool calls: tools/tool_choice checks, call formats by template family, calls parsed and
checked against their schema, constrained calls, streaming, conversations with results.

Fast tests run on the fake backend (byte vocabulary) and the tiny random GGUF models (two
template families); the default model's tests are marked ``model``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.errors import InvalidRequestError
from edgeinfer.generation.results import Chunk, GenerationStats, TokenStream
from edgeinfer.model import Model
from edgeinfer.tools import check_tool_choice, check_tools, detect_format
from edgeinfer.tools.formats import FORMATS, GENERIC_PREAMBLE
from edgeinfer.tools.schema import violation
from edgeinfer.tools.stream import ToolCallStream

from .fakes import FakeBackend
from .tool_templates import CHATML, HERMES, LLAMA3, MISTRAL, TINY_HERMES, TINY_LLAMA3

pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def fake(template: str | None = None, **kw: Any) -> Model:
    model = Model(FakeBackend(n_ctx=4096, **kw), name="fake", path=Path("fake"), model_format="f")
    if template:
        model.use_chat_template(template)
    return model


def assert_valid(call: dict[str, Any], tools: list[dict[str, Any]] = TOOLS) -> None:
    """A call in OpenAI's shape whose arguments satisfy its function's schema (jsonschema)."""
    jsonschema = pytest.importorskip("jsonschema")
    assert set(call) == {"id", "type", "function"} and call["type"] == "function"
    assert call["id"].startswith("call_") or len(call["id"]) == 9
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, schemas[call["function"]["name"]])


# -- checks of tools and tool_choice -------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ({"type": "function"}, "tools"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tools[0].function.parameters",
        ),
        (
            [{"function": {"name": "f", "parameters": {"properties": {"a": {"type": "flt"}}}}}],
            "tools[0].function.parameters.properties.a.type",
        ),
        (
            [{"function": {"name": "f", "parameters": {"required": "a"}}}],
            "tools[0].function.parameters.required",
        ),
        ([{"function": {"name": f"f{i}"}} for i in range(129)], "tools"),
        ([{"function": {"name": "f", "description": "x" * 10**7}}], "tools"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tools: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_tools(tools)
    assert field in str(info.value)


def test_tool_choice_shapes() -> None:
    tools = check_tools(TOOLS)
    assert check_tool_choice(None, tools).mode == "auto"
    assert check_tool_choice(None, ()).mode == "none"
    assert check_tool_choice("auto", ()).mode == "none"
    named = check_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools)
    assert (named.mode, named.name) == ("required", "get_time")
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}, 3, ["auto"]):
        with pytest.raises(InvalidRequestError, match="tool_choice"):
            check_tool_choice(bad, tools)
    with pytest.raises(InvalidRequestError, match="needs tools"):
        check_tool_choice("required", ())


# -- the argument checker against jsonschema ------------------------------------------------

CHECKED_SCHEMAS = [
    WEATHER["function"]["parameters"],
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "n": {"type": ["integer", "null"], "exclusiveMinimum": 0, "multipleOf": 2},
            "kind": {"anyOf": [{"const": "a"}, {"type": "boolean"}]},
            "ref": {"$ref": "#/$defs/point"},
        },
        "$defs": {"point": {"type": "object", "required": ["x"], "properties": {"x": {}}}},
    },
    {"type": "object", "minProperties": 1, "additionalProperties": {"type": "number"}},
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(-4, 4)
    | st.text(max_size=6)
    | st.sampled_from(["Paris", "a", "x"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["city", "days", "tags", "n", "kind", "ref", "x"]), inner)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CHECKED_SCHEMAS), json_values)
def test_the_argument_checker_agrees_with_jsonschema(schema: Any, value: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    expected = jsonschema.Draft202012Validator(schema).is_valid(value)
    assert (violation(value, schema) is None) == expected, violation(value, schema)


# -- template families ----------------------------------------------------------------------


def test_the_family_is_detected_from_the_template() -> None:
    assert detect_format(HERMES).name == "hermes"
    assert detect_format(LLAMA3).name == "llama3"
    assert detect_format(MISTRAL).name == "mistral"
    assert detect_format(CHATML).name == "generic"
    assert detect_format(None).name == "generic"


LOOP = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.mark.parametrize("template", [HERMES, LLAMA3, MISTRAL, CHATML])
def test_conversations_with_calls_and_results_render_in_the_family(template: str) -> None:
    model = fake(template)
    text = model.apply_chat_template(model_messages(model, LOOP), tools=None)
    assert "sunny, 21 C" in text and "get_weather" in text and "Paris" in text
    result = model.chat(LOOP, tools=TOOLS, max_new_tokens=4, seed=0)
    assert result.stats.prompt_tokens > 0


def model_messages(model: Model, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from edgeinfer.tools import ToolRequest

    request = ToolRequest.build(TOOLS, None, None, model.chat_template)
    assert request is not None
    return request.messages(messages)


def test_native_templates_get_tools_and_the_generic_format_a_system_section() -> None:
    hermes = fake(HERMES)
    text = hermes.apply_chat_template(ASK, tools=[WEATHER])
    assert "<tools>" in text and '"get_weather"' in text
    generic = fake(CHATML)
    messages = model_messages(generic, LOOP)
    assert messages[0]["role"] == "system"
    assert messages[0]["content"].startswith(GENERIC_PREAMBLE.split("{")[0])
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        in (messages[2]["content"])
    )
    assert messages[3] == {
        "role": "user",
        "content": '<tool_response name="get_weather">\nsunny, 21 C\n</tool_response>',
    }
    none = fake(CHATML)
    with_none = none.apply_chat_template(ASK)
    from edgeinfer.tools import ToolRequest

    request = ToolRequest.build(TOOLS, "none", None, CHATML)
    assert request is not None
    assert none.apply_chat_template(request.messages(ASK)) == with_none  # none: no tools


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "r"}], "tool_call_id"),
        ([*LOOP, {"role": "tool", "tool_call_id": "call_1", "content": "again"}], "tool_call_id"),
        (
            [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}],
                },
            ],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                },
            ],
            "arguments",
        ),
        ([*ASK, {"role": "assistant", "tool_calls": "x"}], "messages[1].tool_calls"),
    ],
)
def test_bad_tool_messages_are_refused_naming_the_field(
    messages: list[dict[str, Any]], field: str
) -> None:
    model = fake(HERMES)
    with pytest.raises(InvalidRequestError) as info:
        model.chat(messages, tools=TOOLS, max_new_tokens=2)
    assert field in str(info.value)
    assert model.chat(ASK, max_new_tokens=2).finish_reason in ("stop", "length")  # usable


# -- the reply's calls: found, checked, streamed -----------------------------------------------

STATS = GenerationStats(1, 1, 0, 0.0, 0.0, 0.0, 0.0)


def scripted(pieces: list[str], fmt: str, finish: str = "stop") -> ToolCallStream:
    """A ToolCallStream over a reply made of ``pieces`` (one chunk each)."""
    import threading

    chunks = [Chunk(p, (i,)) for i, p in enumerate(pieces)]
    chunks.append(Chunk("", (), finish, STATS))  # type: ignore[arg-type]
    inner = TokenStream(iter(chunks), threading.Event())
    return ToolCallStream(inner, check_tools(TOOLS), FORMATS[fmt])


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
REPLIES = {
    "generic": f"Let me check.\n<tool_call>{CALL}</tool_call>\n",
    "hermes": f"<tool_call>\n{CALL}\n</tool_call>",
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
    "mistral": f"[TOOL_CALLS][{CALL}]",
}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(REPLIES)), st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_calls_are_found_however_the_reply_is_cut_into_chunks(fmt: str, cuts: list[int]) -> None:
    text, pieces = REPLIES[fmt], []
    while text:
        n = cuts[len(pieces) % len(cuts)]
        pieces.append(text[:n])
        text = text[n:]
    stream = scripted(pieces, fmt)
    chunks = list(stream)
    result = stream.result
    assert result is not None and result.tool_call_error is None
    assert result.finish_reason == "tool_calls"
    assert [c["function"] for c in result.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city":"Oslo","days":2}'}
    ]
    assert result.text == "".join(c.text for c in chunks)
    assert result.text == ("Let me check." if fmt == "generic" else "")
    assert sum(len(c.tool_calls) for c in chunks) == 1
    assert list(result.token_ids) == list(range(len(pieces)))


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "not among the tools"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', "city"),
        ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', "required"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}', "not closed"),
        ('<tool_call>{"name": "get_weather", "arguments": "[1,2]"}</tool_call>', "not a JSON obj"),
        ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "nested"),
    ],
)
def test_malformed_calls_are_reported_never_handed_out(reply: str, why: str) -> None:
    stream = scripted([reply[:7], reply[7:]], "generic")
    chunks = list(stream)
    result = stream.result
    assert result is not None
    assert result.tool_calls == () and not any(c.tool_calls for c in chunks)
    assert result.finish_reason == "stop"
    assert result.tool_call_error is not None and why in result.tool_call_error
    assert result.text == reply  # the reply's text is kept as it was


def test_text_that_only_looks_like_a_call_passes_through() -> None:
    stream = scripted(["a <tool", "_ x > b", " [{ c"], "generic")
    assert "".join(c.text for c in stream) == "a <tool_ x > b [{ c"
    llama = scripted(["{", "not json"], "llama3")
    list(llama)
    assert llama.result is not None and llama.result.tool_call_error is not None
    plain = scripted(["Hello", " {x}"], "llama3")
    assert [c.text for c in plain][:1] == ["Hello"]  # text starts: handed out at once


# -- generation: constrained, auto, streamed ---------------------------------------------------


@pytest.mark.parametrize("template", [CHATML, HERMES, LLAMA3, MISTRAL])
def test_required_gives_a_valid_call_in_every_family(template: str) -> None:
    model = fake(template)
    for seed in range(3):
        result = model.chat(
            ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed,
            max_new_tokens=600,
        )  # fmt: skip
        assert result.finish_reason == "tool_calls", (result.text, result.tool_call_error)
        assert len(result.tool_calls) == 1
        assert_valid(result.tool_calls[0])


def test_a_named_function_is_the_one_called_and_streams_as_a_chunk() -> None:
    model = fake(CHATML)
    choice = {"type": "function", "function": {"name": "get_time"}}
    stream = model.chat(
        ASK, tools=TOOLS, tool_choice=choice, stream=True, max_new_tokens=600,
        parallel_tool_calls=False,
    )  # fmt: skip
    chunks = list(stream)
    assert stream.result is not None and stream.result.finish_reason == "tool_calls"
    carrying = [c for c in chunks if c.tool_calls]
    assert len(carrying) == 1 and carrying[0].tool_calls == stream.result.tool_calls
    assert stream.result.tool_calls[0]["function"]["name"] == "get_time"
    assert_valid(stream.result.tool_calls[0])


def test_parallel_calls_each_validate_and_a_cut_one_is_reported() -> None:
    """Each seed's forced reply ends in one or more valid calls; the same seed's reply cut a
    few tokens before that end keeps the calls complete by then and reports the cut one."""
    model = fake(CHATML)
    for seed in range(3):
        ask = {"tools": TOOLS, "tool_choice": "required", "seed": seed}
        stream = model.chat(ASK, **ask, stream=True, max_new_tokens=300)
        chunks = list(stream)
        result = stream.result
        assert result is not None
        assert result.finish_reason == "tool_calls" and result.tool_call_error is None
        assert len(result.tool_calls) >= 1
        assert [c for chunk in chunks for c in chunk.tool_calls] == list(result.tool_calls)
        for call in result.tool_calls:
            assert_valid(call)
        cut = model.chat(ASK, **ask, max_new_tokens=result.stats.completion_tokens - 5)
        assert cut.finish_reason == "length" and cut.tool_call_error, cut.text
        assert "not closed" in cut.tool_call_error
        # the cut call is the last one written: the last handed out, or a repeat that ended
        # the whole reply (dropped there, so the cut keeps every call)
        kept = [c["function"] for c in cut.tool_calls]
        assert len(kept) >= len(result.tool_calls) - 1
        assert kept == [c["function"] for c in result.tool_calls[: len(kept)]]


def test_auto_and_none_leave_the_reply_free() -> None:
    model = fake(CHATML)
    for seed in range(3):
        result = model.chat(ASK, tools=TOOLS, seed=seed, max_new_tokens=30)
        for call in result.tool_calls:
            assert_valid(call)
        none = model.chat(ASK, tools=TOOLS, tool_choice="none", seed=seed, max_new_tokens=30)
        plain = model.chat(ASK, seed=seed, max_new_tokens=30)
        assert none.token_ids == plain.token_ids and none.tool_calls == ()


GRAMMAR_SCHEMAS = [
    {"type": "object", "properties": {}},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2]}}},
    {
        "type": "object",
        "properties": {"a": {"enum": ["x"]}, "b": {"type": "integer"}, "c": {"const": None}},
        "required": ["b"],
    },
    {
        "type": "object",
        "properties": {"t": {"type": "array", "items": {"enum": [1]}, "maxItems": 2}},
    },
    {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 2},
    {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/b"}},
        "required": ["p"],
        "$defs": {"b": {"type": "boolean"}},
    },
]


@settings(max_examples=24, deadline=None)
@given(st.sampled_from(GRAMMAR_SCHEMAS), st.integers(0, 2**16))
def test_forced_arguments_satisfy_the_schema(schema: dict[str, Any], seed: int) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    result = fake(CHATML).chat(ASK, tools=[tool], tool_choice="required", seed=seed,
                               parallel_tool_calls=False, max_new_tokens=300)  # fmt: skip
    if result.finish_reason == "tool_calls":
        assert len(result.tool_calls) == 1 and result.tool_call_error is None
        assert_valid(result.tool_calls[0], [tool])
    else:  # the budget ran out mid-call: reported, never handed out
        assert result.finish_reason == "length" and result.tool_calls == ()
        assert result.tool_call_error


def test_required_with_a_response_format_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="response_format"):
        fake(CHATML).chat(
            ASK, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}
        )


# -- tiny random GGUF models of two families -------------------------------------------------


TINY_TOOL = {
    "type": "function",
    "function": {
        "name": "t",
        "parameters": {
            "type": "object",
            "properties": {"z": {"enum": ["UTC", "CET"]}},
            "required": ["z"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tiny_models(tiny_llama_gguf: Path, tiny_qwen2_gguf: Path) -> Iterator[list[Model]]:
    pytest.importorskip("llama_cpp")
    import edgeinfer

    models = [
        edgeinfer.load(tiny_llama_gguf, context_length=256, threads=1),
        edgeinfer.load(tiny_qwen2_gguf, context_length=256, threads=1),
    ]
    yield models
    for model in models:
        model.close()


@pytest.mark.parametrize(("template", "family"), [(TINY_HERMES, "hermes"), (TINY_LLAMA3, "llama3")])
def test_tiny_models_make_valid_forced_calls_and_finish_the_loop(
    tiny_models: list[Model], template: str, family: str
) -> None:
    assert detect_format(template).name == family
    tools = [TINY_TOOL]  # the tiny models hold 256 tokens
    for model in tiny_models:
        model.use_chat_template(template)
        ask = [{"role": "user", "content": "Time?"}]
        result = model.chat(ask, tools=tools, tool_choice="required", parallel_tool_calls=False,
                            seed=1, max_new_tokens=120)  # fmt: skip
        assert result.finish_reason == "tool_calls", (result.text, result.tool_call_error)
        assert len(result.tool_calls) == 1
        assert_valid(result.tool_calls[0], tools)
        call = dict(result.tool_calls[0])
        loop = [*ask, {"role": "assistant", "content": None, "tool_calls": [call]}]
        loop.append({"role": "tool", "tool_call_id": call["id"], "content": "9:00"})
        answer = model.chat(loop, tools=tools, tool_choice="none", max_new_tokens=8, seed=0)
        assert answer.tool_calls == () and answer.finish_reason in ("stop", "length")


# -- the default model ------------------------------------------------------------------------


@pytest.mark.model
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.just(0))
def test_default_model_required_calls_all_validate(default_model: Model, _: int) -> None:
    assert detect_format(default_model.chat_template).name == "generic"
    questions = [
        "What's the weather in Oslo for the next 2 days?",
        "What time is it in Paris (CET)?",
        "Tell me a joke.",
        "Is it raining in Lima?",
    ]
    for i, question in enumerate(questions):
        messages = [{"role": "user", "content": question}]
        result = default_model.chat(
            messages, tools=TOOLS, tool_choice="required", temperature=0, max_new_tokens=120,
            parallel_tool_calls=False,
        )  # fmt: skip
        assert result.finish_reason == "tool_calls", (i, result.text, result.tool_call_error)
        assert len(result.tool_calls) == 1, (i, result.tool_calls)
        for call in result.tool_calls:
            assert_valid(call)
        call = dict(result.tool_calls[0])
        loop = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]}]
        loop.append({"role": "tool", "tool_call_id": call["id"], "content": '{"result": "ok"}'})
        answer = default_model.chat(loop, tools=TOOLS, temperature=0, max_new_tokens=40)
        for call in answer.tool_calls:
            assert_valid(call)
        assert answer.text or answer.tool_calls or answer.tool_call_error
        assert "<tool_response" not in answer.text


def test_run_prints_the_call_as_json(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    pytest.importorskip("llama_cpp")
    (tmp_path / "tools.json").write_text(json.dumps([TINY_TOOL]))
    (tmp_path / "hermes.jinja").write_text(TINY_HERMES)
    argv = [sys.executable, "-m", "edgeinfer.cli", "run", str(tiny_llama_gguf), "-p", "Time?",
            "--tools", str(tmp_path / "tools.json"), "--tool-choice", "t", "--seed", "1",
            "--chat-template", str(tmp_path / "hermes.jinja"), "--context-length", "256",
            "--threads", "1", "--max-new-tokens", "120"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    call = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(call, dict)
    assert_valid(call, [TINY_TOOL])
    done = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300)
    record = json.loads(done.stdout)
    assert record["finish_reason"] == "tool_calls" and record["tool_call_error"] is None
    assert len(record["tool_calls"]) == 1
    assert_valid(record["tool_calls"][0], [TINY_TOOL])
    assert record["tool_calls"][0]["function"] == call["function"]
