"""``/v1/responses`` against hostile input. Hypothesis drives the parser (fast: hundreds of
bodies), the application in-process (Starlette's test client over the tiny GGUF: every
answer is a response object or an error in OpenAI's shape naming a Responses field, never a
500) and raw bytes (nesting, sizes, broken UTF-8, lone surrogates). The store's bounds (count,
size, age) are checked directly. A crash test runs the real ``edgeinfer serve``, sends it the
hostile bodies and a stream it leaves mid-reply, and checks that it still answers the
official openai client and stops cleanly (no traceback in its log)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import edgeinfer

hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .test_serve import CONTEXT, Server, _start  # noqa: E402
from .test_serve_hostile import _nested, cases, json_value  # noqa: E402
from .test_serve_speculative import SETTINGS, runs, sendable  # noqa: E402

FIELDS = (
    "model input instructions previous_response_id tools tool_choice parallel_tool_calls text "
    "max_output_tokens temperature top_p seed logit_bias stream store metadata user include "
    "reasoning truncation background conversation prompt top_logprobs max_tool_calls "
    "service_tier stream_options speculative"
).split()
BAN_EOS = {"2": -100}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}

# -- strategies -------------------------------------------------------------------------------

texts = st.text(max_size=12) | st.sampled_from(["\ud800", "\x00", "é日本", "<|im_end|>", ""])
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "text", "refusal", "input_image"])},
    optional={"text": texts | json_value, "refusal": texts, "image_url": texts},
)
contents = texts | st.lists(parts | json_value, max_size=3) | json_value
items = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x"])},
        optional={"content": contents, "type": st.sampled_from(["message", "msg", None])},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call")},
        optional={
            "call_id": texts | json_value,
            "name": st.sampled_from(["f", "g", "bad name"]) | json_value,
            "arguments": st.sampled_from(["{}", '{"a": 1}', "[]", "{", ""]) | json_value,
        },
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output")},
        optional={"call_id": texts | json_value, "output": contents},
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search"])}),
    json_value,
)
inputs = texts | st.lists(items, max_size=5) | json_value
formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "yaml"}]),
    st.fixed_dictionaries(
        {"type": st.just("json_schema")},
        optional={"name": texts, "schema": json_value | st.just({"type": "object"})},
    ),
    json_value,
)


@st.composite
def bodies(draw: Any) -> dict[str, Any]:
    """Bodies near the real shape with wrong types and values in any field; generation is
    kept short so that valid ones finish fast."""
    body: dict[str, Any] = {"input": draw(st.just("Hi") | inputs), "max_output_tokens": 2}
    body["logit_bias"] = BAN_EOS
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        strategy = {
            "input": inputs,
            "text": st.fixed_dictionaries({}, optional={"format": formats}) | json_value,
            "tools": st.lists(st.just(TOOL) | json_value, max_size=3) | json_value,
            "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function"}])
            | st.just({"type": "function", "name": "f"})
            | json_value,
            "speculative": SETTINGS | json_value,
        }.get(key, json_value | st.sampled_from([2**63, 10**30, -1, 0, 1.5]))
        body[key] = draw(strategy)
    if not isinstance(body.get("max_output_tokens"), int) or body["max_output_tokens"] > 4:
        body["max_output_tokens"] = 2  # keep any accepted request short
    body.pop("stream", None)  # a stream's reply is not one JSON document
    return body


# -- the parser -------------------------------------------------------------------------------


@cases(400)
@given(body=bodies() | json_value)
def test_the_parser_gives_a_chat_request_or_a_400_naming_a_responses_field(body: Any) -> None:
    from edgeinfer.serve import wire
    from edgeinfer.serve.response_store import ResponseStore
    from edgeinfer.serve.responses import parse_response

    try:
        parsed = parse_response(body, ResponseStore())
    except wire.WireError as exc:
        assert exc.status == 400 and exc.message and len(exc.message) < 2000
        if isinstance(body, dict) and exc.code != "invalid_json":
            root = (exc.param or "").split("[")[0].split(".")[0]
            assert root in FIELDS, (exc.param, exc.message)
            assert "messages[" not in exc.message and "max_tokens" not in exc.message
        return
    assert parsed.chat.messages and all(m["role"] != "developer" for m in parsed.chat.messages)


# -- the application in-process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_gguf: Path) -> Iterator[edgeinfer.Model]:
    with edgeinfer.load(tiny_llama_gguf, context_length=CONTEXT, threads=1) as model:
        yield model


@pytest.fixture(scope="module")
def app(tiny: edgeinfer.Model) -> Iterator[Any]:
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    with TestClient(
        create_app(tiny, ServerConfig(name="m")), base_url="http://127.0.0.1:8080"
    ) as client:
        yield client


def _is_error(r: Any, *statuses: int) -> dict[str, Any]:
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in r.text
    return body["error"]


@cases(150)
@given(body=bodies())
def test_any_body_is_a_response_or_an_openai_error_never_a_500(app: Any, body: Any) -> None:
    raw = json.dumps(body).encode()  # ASCII: a lone surrogate goes as its escape
    r = app.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
    if r.status_code == 200:
        reply = r.json()
        assert reply["object"] == "response" and reply["status"] in ("completed", "incomplete")
        assert reply["usage"]["total_tokens"] >= reply["usage"]["output_tokens"]
        return
    error = _is_error(r, 400, 404)
    if r.status_code == 400 and error["code"] != "invalid_json":
        assert (error["param"] or "").split("[")[0].split(".")[0] in FIELDS, error


@cases(100)
@given(value=SETTINGS | json_value)
def test_any_speculative_value_is_a_response_or_a_400_naming_it(app: Any, value: Any) -> None:
    """The field as chat completions read it: what the model runs answers, anything else is
    a 400 naming ``speculative`` (a body that is not strict JSON: a 400 of its own)."""
    body = {"input": "Hi", "max_output_tokens": 2, "logit_bias": BAN_EOS, "speculative": value}
    r = app.post("/v1/responses", content=json.dumps(body).encode(),
                 headers={"content-type": "application/json"})  # fmt: skip
    if not sendable(value):
        _is_error(r, 400)
    elif runs(value):
        assert r.status_code == 200, r.text[:500]
        assert r.json()["status"] in ("completed", "incomplete")
    else:
        error = _is_error(r, 400)
        assert error["param"] == "speculative" and error["code"] == "invalid_value", error


unholdable = st.one_of(
    st.integers(1, 3000).map(lambda n: ('{"input": ' + _nested(n, '"x"') + "}").encode()),
    st.integers(1, 3000).map(lambda n: b'{"input": [{"role": "user", "content": ' + b"[" * n),
    st.integers(20, 3000).map(lambda n: b'{"input": "Hi", "max_output_tokens": ' + b"9" * n + b"}"),
    st.sampled_from([r"\ud800", r"\udfff", r"\ud83d\ude00x\udc00"]).map(
        lambda s: ('{"input": [{"role": "user", "content": "' + s + '"}]}').encode()
    ),
    st.sampled_from([b'{"input": "\xff\xfe"}', b'{"instructions": "\xc3"}', b"\xef\xbb\xbf{}"]),
    st.sampled_from([b'{"input": "Hi", "temperature": NaN}', b"Infinity", b"null", b"[]"]),
    st.binary(max_size=64),
)


@cases(150)
@given(raw=unholdable)
def test_unholdable_bytes_are_400_never_500(app: Any, raw: bytes) -> None:
    r = app.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
    _is_error(r, 400)


def test_sizes_past_the_bounds_are_refused(app: Any) -> None:
    many = [{"role": "user", "content": "x"}] * 5000
    error = _is_error(app.post("/v1/responses", json={"input": many}), 400)
    assert error["param"] == "input" and "4096" in error["message"]
    huge = b'{"input": "' + b"x" * (5 * 2**20) + b'"}'
    _is_error(app.post("/v1/responses", content=huge), 413)
    calls = [
        {"type": "function_call", "call_id": f"call_{i}", "name": "f", "arguments": "{}"}
        for i in range(200)
    ]
    error = _is_error(app.post("/v1/responses", json={"input": ["x", *calls][1:]}), 400)
    assert error["param"].startswith("input[0]")
    long_id = "resp_" + "a" * 100_000
    error = _is_error(
        app.post("/v1/responses", json={"input": "x", "previous_response_id": long_id}), 400
    )
    assert error["param"] == "previous_response_id" and len(error["message"]) < 400
    assert app.get("/v1/responses/" + "z" * 5000).status_code == 404
    r = app.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200  # still answering


# -- the store's bounds -----------------------------------------------------------------------


def test_the_store_keeps_the_newest_within_count_size_and_age(monkeypatch: Any) -> None:
    from edgeinfer.serve import response_store
    from edgeinfer.serve.response_store import ResponseStore

    clock = [1000.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: clock[0])
    store = ResponseStore(max_items=3, max_chars=2000, ttl_s=60)
    for i in range(5):
        assert store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    assert not store.put("big", {"id": "big"}, [{"role": "user", "content": "x" * 3000}])
    store.put("r5", {"id": "r5"}, [{"role": "user", "content": "y" * 1930}])
    assert store.get("r5") is not None and len(store) == 1  # the older ones pushed out by size
    assert store.delete("r5") and not store.delete("r5") and len(store) == 0
    store.put("r6", {"id": "r6"}, [])
    clock[0] += 61
    assert store.get("r6") is None and len(store) == 0  # expired
    assert "60 minutes" in ResponseStore().terms and "1 minutes" in store.terms


# -- the real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_gguf: Path) -> Iterator[Server]:
    yield from _start(tiny_llama_gguf)


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP = _deep_schema(60)
HOSTILE = [
    b'{"input": ' + b"[" * 5000,
    ('{"input": ' + _nested(3000, '"x"') + "}").encode(),
    b'{"input": "' + b"y" * (5 * 2**20) + b'"}',
    b'{"input": [{"role": "user", "content": "\\ud800"}], "stream": true}',
    b'{"input": "\xff\xfe", "stream": true}',
    json.dumps({"input": [{"type": "function_call", "call_id": 5}] * 3000}).encode(),
    json.dumps({"input": "x", "tools": [{"type": "function", "name": "f" * 10**5}]}).encode(),
    json.dumps(
        {"input": "x", "text": {"format": {"type": "json_schema", "schema": DEEP}}}
    ).encode(),
    b"\x00" * 1000,
]


def test_the_server_survives_hostile_bodies_and_a_client_that_leaves(server: Server) -> None:
    url = f"{server.url}/v1/responses"
    for raw in HOSTILE:
        r = httpx.post(url, content=raw, timeout=60)
        assert r.status_code in (400, 413), (raw[:40], r.status_code, r.text[:300])
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    body = {"input": "Once upon a time", "stream": True, "max_output_tokens": CONTEXT}
    with httpx.stream("POST", url, json={**body, "logit_bias": BAN_EOS}, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("event: response.output_text.delta")
            if seen == 3:
                break  # hang up mid-stream
    deadline = time.monotonic() + 30  # the access line follows the cancelled generation
    while time.monotonic() < deadline and not server.lines(r"path=/v1/responses .*status=499"):
        time.sleep(0.05)
    (line,) = server.lines(r"path=/v1/responses .*status=499")
    assert int(re.search(r"tokens_after_cancel=(\d+)", line).group(1)) <= 2, line
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    reply = client.responses.create(model="default", input="Hi", max_output_tokens=3)
    assert reply.status in ("completed", "incomplete") and server.process.poll() is None
    events = list(
        client.responses.create(model="default", input="Hi", max_output_tokens=3, stream=True)
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
