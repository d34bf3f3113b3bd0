"""``/v1/responses`` for real: the ``edgeinfer serve`` process on the tiny GGUF driven by the
official openai client (whole and streamed), each answer compared with the chat completion
the same server gives for the same conversation; function tools through the whole loop (call
item, function_call_output, previous_response_id) on the Hermes-template server; structured
output; refusals in OpenAI's shape naming the Responses field; and openai-agents' default
``Agent`` running a function tool against the server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from .test_serve import KEY, Server, _start
from .test_serve_tools import hermes  # noqa: F401 - the Hermes-template server fixture

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}
CHAT_GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}
TOOL = {
    "type": "function",
    "name": "get_time",
    "description": "the time in a zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def server(tiny_llama_gguf: Path) -> Iterator[Server]:
    yield from _start(tiny_llama_gguf, "--api-key", KEY)


def _chat(server: Server, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return server.client().chat.completions.create(
        model="default", messages=messages, **CHAT_GREEDY, **extra
    )


def _status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


def test_text_input_with_instructions_is_the_chat_reply(server: Server) -> None:
    reply = server.client().responses.create(
        model="default", input="Hello there", instructions="Be brief.", **GREEDY
    )
    system = {"role": "system", "content": "Be brief."}
    chat = _chat(server, [system, {"role": "user", "content": "Hello there"}])
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == _status(chat.choices[0].finish_reason)
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in reply.output] == ["message"]
    assert reply.output[0].role == "assistant" and reply.output[0].content[0].type == "output_text"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.instructions == "Be brief." and reply.model == server.model


def test_items_with_developer_role_and_text_parts_are_the_chat_reply(server: Server) -> None:
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": "And then?"},
    ]
    reply = server.client().responses.create(model="default", input=items, **GREEDY)
    chat = _chat(
        server,
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


def test_the_stream_sends_openais_events_in_order(server: Server) -> None:
    client = server.client()
    whole = client.responses.create(model="default", input="Tell me a story", **GREEDY)
    events = list(
        client.responses.create(model="default", input="Tell me a story", stream=True, **GREEDY)
    )
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[4:] == ["response.output_text.delta"] * len(deltas) + [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_previous_response_id_continues_the_conversation(server: Server) -> None:
    client = server.client()
    first = client.responses.create(model="default", input="Hi", instructions="Be kind.", **GREEDY)
    second = client.responses.create(
        model="default", input="More please", previous_response_id=first.id, **GREEDY
    )
    chat = _chat(
        server,
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "More please"},
        ],
    )  # instructions are not carried over, as OpenAI's are not
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="default", input="x", previous_response_id=first.id)
    assert info.value.body["param"] == "previous_response_id"
    assert "kept in memory for 60 minutes" in info.value.body["message"]
    unkept = client.responses.create(model="default", input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_text_format_json_schema_is_structured_output(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}
    reply = server.client().responses.create(
        model="default", input="Answer", text={"format": fmt}, max_output_tokens=60, temperature=0
    )
    assert reply.status == "completed", reply
    jsonschema.validate(json.loads(reply.output_text), schema)
    assert reply.text.format.type == "json_schema"


def _valid_call(item: Any) -> dict[str, Any]:
    assert item.type == "function_call" and item.name == "get_time"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, TOOL["parameters"])
    return arguments


def test_a_forced_call_and_its_output_through_items_and_previous_id(hermes: Server) -> None:  # noqa: F811
    client = hermes.client()
    ask = [{"role": "user", "content": "Time?"}]
    first = client.responses.create(
        model="default", input=ask, tools=[TOOL], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, temperature=0,
    )  # fmt: skip
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    _valid_call(call)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "09:00"}
    # the whole conversation as items, the call item as the client got it
    by_items = client.responses.create(
        model="default", input=[*ask, call.model_dump(exclude_none=True), result],
        tools=[TOOL], max_output_tokens=6, temperature=0,
    )  # fmt: skip
    by_id = client.responses.create(
        model="default", input=[result], previous_response_id=first.id, tools=[TOOL],
        max_output_tokens=6, temperature=0,
    )  # fmt: skip
    assert by_items.output_text == by_id.output_text
    assert by_items.usage.input_tokens == by_id.usage.input_tokens > first.usage.input_tokens
    named = client.responses.create(
        model="default", input=ask, tools=[TOOL], max_output_tokens=120, temperature=0,
        tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
    )  # fmt: skip
    assert [_valid_call(i) for i in named.output if i.type == "function_call"]


def test_a_streamed_call_sends_its_item_and_arguments(hermes: Server) -> None:  # noqa: F811
    client = hermes.client()
    events = list(
        client.responses.create(
            model="default", input="Time?", tools=[TOOL], tool_choice="required", stream=True,
            parallel_tool_calls=False, max_output_tokens=120, temperature=0,
        )
    )  # fmt: skip
    final = events[-1].response
    assert events[-1].type == "response.completed"
    (call,) = [item for item in final.output if item.type == "function_call"]
    _valid_call(call)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments] and done[0].item_id == call.id
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[-1].type == "function_call" and added[-1].status == "in_progress"


ORPHAN_OUTPUT = {"type": "function_call_output", "call_id": "call_x", "output": "r"}
BAD = [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 9}, "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**TOOL, "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": [ORPHAN_OUTPUT]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"metadata": {"k": 5}}, "metadata"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_fields_are_400_naming_the_responses_field(
    server: Server, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "default", "input": "Hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().responses.create(**body)
    error = info.value.body
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_model_and_a_prompt_over_the_context(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.client().responses.create(model="gpt-9", input="Hi")
    assert "--any-model-name" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        server.client().responses.create(model="default", input="word " * 600)
    assert too_long.value.body["param"] == "input"
    assert too_long.value.body["code"] == "context_length_exceeded"


def test_openai_agents_runs_a_function_tool(hermes: Server) -> None:  # noqa: F811
    """The default Agent loop: a forced call, the tool run, the call's output sent back and
    a final message, whole and streamed. The tiny random model is steered to end each reply
    as soon as it may (a logit bias toward its end-of-text id, 2, sent as edgeinfer's
    logit_bias extension): the call's grammar still holds it to a whole call."""
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone (a closed choice: the random model's free text never ends)."""
        calls.append(zone)
        return "09:00"

    def agent() -> Any:  # a client of its own for each event loop
        client = openai.AsyncOpenAI(base_url=f"{hermes.url}/v1", api_key=KEY, max_retries=0)
        return Agent(
            name="clock",
            instructions="Say the time.",
            tools=[get_time],
            model=OpenAIResponsesModel(model="default", openai_client=client),
            model_settings=ModelSettings(
                tool_choice="required", max_tokens=120, temperature=0, parallel_tool_calls=False,
                extra_body={"logit_bias": {"2": 100}},
            ),
        )  # fmt: skip

    result = Runner.run_sync(agent(), "What time is it?", max_turns=4)
    assert calls == ["UTC"] or calls == ["CET"]
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]

    async def streamed() -> Any:
        run = Runner.run_streamed(agent(), "What time is it?", max_turns=4)
        async for _ in run.stream_events():
            pass
        return run

    run = asyncio.run(streamed())
    assert len(calls) == 2 and calls[1] in ("UTC", "CET") and run.is_complete
    assert [item.type for item in run.new_items] == kinds


def test_events_close_the_message_before_a_call_and_a_failure_ends_the_stream() -> None:
    """The event builder alone: text, a call, more text; and a generation failing mid-way."""
    from edgeinfer.generation.results import Chunk, GenerationResult, GenerationStats
    from edgeinfer.serve.response_objects import ResponseShape
    from edgeinfer.serve.response_store import ResponseStore
    from edgeinfer.serve.response_stream import Events

    store = ResponseStore()
    shape = ResponseShape("resp_1", "m", 0, {}, {}, [{"role": "user", "content": "q"}], store)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events = Events(shape)
    out = events.opening() + events.chunk(Chunk("a", (1,)))
    out += events.chunk(Chunk("b", (2,), tool_calls=(call,))) + events.chunk(Chunk("c", (3,)))
    stats = GenerationStats(3, 3, 0, 0.1, 1.0, 1.0, 0.2)
    out += events.end(GenerationResult("abc", (1, 2, 3), "tool_calls", stats, tool_calls=(call,)))
    kinds = [e["type"].removeprefix("response.") for e in out]
    item = ["output_item.added", "content_part.added"]
    text_done = ["output_text.done", "content_part.done", "output_item.done"]
    call_events = ["function_call_arguments.delta", "function_call_arguments.done"]
    assert kinds == [
        "created", "in_progress", *item, "output_text.delta", "output_text.delta", *text_done,
        "output_item.added", *call_events, "output_item.done", *item, "output_text.delta",
        *text_done, "completed",
    ]  # fmt: skip
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "message"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert store.get("resp_1").messages[-1]["tool_calls"] == [call]  # kept for the next turn
    failing = Events(shape)
    ends = failing.chunk(Chunk("a", (1,))) + failing.failed({"message": "boom", "code": None})
    assert [e["type"] for e in ends[-2:]] == ["error", "response.failed"]
    assert ends[-1]["response"]["status"] == "failed"
    assert ends[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
