"""The server's tools: the real ``edgeinfer serve`` process and the official openai client
running the whole loop (call -> tool result -> answer), whole and streamed, on the tiny GGUF
with a forced call; bad tools fields are 400 naming the field and the server keeps serving;
the default model (marked) with ``required``: every call validates."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .test_serve import KEY, Server, _free_port, _start
from .tool_templates import TINY_HERMES

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "the time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Time?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_gguf: Path) -> Iterator[Server]:
    """The real ``edgeinfer serve`` process on the tiny GGUF (its own chatml template)."""
    yield from _start(tiny_llama_gguf, "--api-key", KEY)


@pytest.fixture(scope="module")
def hermes(tiny_llama_gguf: Path) -> Iterator[Server]:
    """The serve command's server (uvicorn, the app) in a thread of this process, over the
    tiny GGUF rendering a Hermes-family template short enough for its 256 tokens."""
    uvicorn = pytest.importorskip("uvicorn")
    import edgeinfer
    from edgeinfer.cli.serve import _server
    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    model = edgeinfer.load(tiny_llama_gguf, context_length=256, threads=1)
    model.use_chat_template(TINY_HERMES)
    port = _free_port()
    app = create_app(model, ServerConfig(name="tiny", api_key=KEY))
    server = _server(uvicorn, app, "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield Server(f"http://127.0.0.1:{port}", None, [], "tiny")  # type: ignore[arg-type]
    finally:
        server.should_exit = True
        thread.join(60)
        model.close()


def _valid(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_time"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, TOOL["function"]["parameters"])
    return arguments


def _loop_messages(call_id: str, arguments: str) -> list[dict[str, Any]]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_time", "arguments": arguments},
    }
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "09:00"},
    ]


def test_whole_loop_with_a_forced_call(hermes: Server) -> None:
    client = hermes.client()
    first = client.chat.completions.create(
        model="default", messages=ASK, tools=[TOOL], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, seed=1,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    _valid(call)
    answer = client.chat.completions.create(
        model="default", messages=_loop_messages(call.id, call.function.arguments),
        tools=[TOOL], max_tokens=6, seed=0,
    )  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_loop_builds_the_same_call(hermes: Server) -> None:
    client = hermes.client()
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(
        model="default", messages=ASK, tools=[TOOL], tool_choice=named, stream=True,
        parallel_tool_calls=False, max_tokens=120, seed=1,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += piece.id or ""
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOL["function"]["parameters"])
    whole = client.chat.completions.create(
        model="default", messages=ASK, tools=[TOOL], tool_choice=named,
        parallel_tool_calls=False, max_tokens=120, seed=1, temperature=0,
    )  # fmt: skip
    _valid(whole.choices[0].message.tool_calls[0])
    answer = client.chat.completions.create(
        model="default", messages=_loop_messages(calls[0]["id"], calls[0]["arguments"]),
        max_tokens=6, stream=True,
    )  # fmt: skip
    assert [c for c in answer if c.choices and c.choices[0].finish_reason]


BAD = [
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": {"x": 1}}, "tools"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"function": {"name": f"f{i}"}} for i in range(500)]}, "tools"),
    (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "r"}]},
        "messages[1].tool_call_id",
    ),
    (
        {"messages": _loop_messages("call_1", "{not json")[:2]},
        "messages[1].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_tool_fields_are_400_naming_the_field(
    server: Server, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "default", "messages": ASK, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(**body)
    assert info.value.body["param"] == param, info.value.body
    ok = server.client().chat.completions.create(model="default", messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")  # still serving


@pytest.mark.model
def test_default_model_forced_calls_validate_through_the_server(default_gguf: Path) -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
    for server in _start(default_gguf, "--api-key", KEY, "--context-length", "2048"):
        client = server.client()
        messages: list[Any] = [{"role": "user", "content": "Weather in Oslo tomorrow?"}]
        first = client.chat.completions.create(
            model="default", messages=messages, tools=[weather], tool_choice="required",
            max_tokens=100, temperature=0, parallel_tool_calls=False,
        )  # fmt: skip
        assert first.choices[0].finish_reason == "tool_calls"
        for call in first.choices[0].message.tool_calls:
            jsonschema.validate(
                json.loads(call.function.arguments), weather["function"]["parameters"]
            )
        call = first.choices[0].message.tool_calls[0]
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "rain, 4 C"})
        final = client.chat.completions.create(
            model="default", messages=messages, tools=[weather], max_tokens=60, temperature=0,
            stream=True,
        )  # fmt: skip
        ends = [c.choices[0].finish_reason for c in final if c.choices]
        assert ends[-1] in ("stop", "length", "tool_calls")  # the answer streamed to its end
