"""Hostile tools input: any shape of tools, tool_choice, parallel_tool_calls and tool
messages is a result or an InvalidRequestError (400 in the server), and the model stays
usable; ``edgeinfer run --tools`` over bad files exits with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.errors import InvalidRequestError
from edgeinfer.model import Model

from .fakes import FakeBackend
from .test_tools import ASK, TOOLS, WEATHER

pytest.importorskip("llguidance")

CASES = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["object", "function", "get_weather", "auto", "required", "none", "\ud800"]),
)
values = st.recursive(
    leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "function",
                    "name",
                    "parameters",
                    "properties",
                    "required",
                    "items",
                    "enum",
                    "description",
                    "$ref",
                    "anyOf",
                    "x",
                ]
            )
            | st.text(max_size=4),
            inner,
            max_size=4,
        )
    ),
    max_leaves=16,
)
tools_like = st.one_of(values, st.lists(st.one_of(values, st.just(WEATHER)), max_size=3))
choice_like = st.one_of(
    values,
    st.sampled_from(["auto", "none", "required"]),
    st.builds(lambda n: {"type": "function", "function": {"name": n}}, values),
)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(FakeBackend(n_ctx=4096), name="fake", path=Path("fake"), model_format="f")


def _usable(model: Model) -> None:
    assert model.chat(ASK, max_new_tokens=2).finish_reason in ("stop", "length")


@CASES
@given(tools_like, choice_like, st.one_of(st.none(), st.booleans(), values))
def test_any_tools_shape_is_a_result_or_an_invalid_request(
    model: Model, tools: Any, choice: Any, parallel: Any
) -> None:
    try:
        result = model.chat(ASK, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                            max_new_tokens=3, seed=0)  # fmt: skip
    except InvalidRequestError as exc:
        assert str(exc) and "Traceback" not in str(exc)
    else:
        assert result.finish_reason in ("stop", "length", "tool_calls")
    _usable(model)


function_like = st.fixed_dictionaries(
    {
        "name": st.one_of(st.just("get_weather"), values),
        "arguments": st.one_of(st.just('{"city": "Oslo"}'), values),
    }
)
call_like = st.fixed_dictionaries(
    {"id": st.one_of(st.just("call_1"), values), "type": st.just("function"),
     "function": function_like},
)  # fmt: skip
message_like = st.one_of(
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.one_of(st.none(), st.text(max_size=5))},
        optional={"tool_calls": st.one_of(st.lists(call_like, max_size=2), values)},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": st.one_of(st.text(max_size=5), values)},
        optional={"tool_call_id": st.one_of(st.just("call_1"), values)},
    ),
    st.just({"role": "user", "content": "hi"}),
)


@CASES
@given(st.lists(message_like, min_size=1, max_size=5))
def test_any_tool_conversation_is_a_result_or_an_invalid_request(
    model: Model, messages: list[Any]
) -> None:
    try:
        model.chat([*ASK, *messages], tools=TOOLS, max_new_tokens=2, seed=0)
    except InvalidRequestError as exc:
        assert str(exc)
    _usable(model)


def test_huge_tools_lists_are_refused_fast(model: Model) -> None:
    big = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 8000}}
           for i in range(100)]  # fmt: skip
    with pytest.raises(InvalidRequestError, match="tools"):
        model.chat(ASK, tools=big)
    with pytest.raises(InvalidRequestError, match="tools"):
        model.chat(ASK, tools=[{"function": {"name": "f", "description": "y" * 10**7}}])
    deep: Any = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidRequestError, match="tools"):
        model.chat(ASK, tools=[{"function": {"name": "f", "parameters": deep}}])
    _usable(model)


# -- the server, in-process -------------------------------------------------------------------


@CASES
@given(tools_like, choice_like, st.one_of(st.none(), values))
def test_the_server_answers_any_tools_shape_with_200_or_400(
    model: Model, tools: Any, choice: Any, parallel: Any
) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    body = {"messages": ASK, "max_tokens": 2, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel}  # fmt: skip
    try:
        data = json.dumps(body, allow_nan=False)
    except (ValueError, UnicodeEncodeError):
        return  # not JSON: the body parser's own tests cover such bytes
    app = create_app(model, ServerConfig(name="m"))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        r = client.post("/v1/chat/completions", content=data.encode("utf-8", "surrogatepass"),
                        headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- the CLI -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        json.dumps([WEATHER, WEATHER]).encode(),
        json.dumps([{"function": {"name": "f", "parameters": {"type": "nope"}}}]).encode(),
        b"[" * 100_000 + b"]" * 100_000,
        b"\xff\xfe\x00",
        b" " * (10 * 2**20),
        None,  # a directory
    ],
)
def test_run_with_bad_tools_files_exits_with_one_line(
    tmp_path: Path, content: bytes | None
) -> None:
    path = tmp_path / "tools.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    argv = [sys.executable, "-m", "edgeinfer.cli", "run", str(tmp_path / "no-model.gguf"),
            "-p", "hi", "--tools", str(path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "tools" in lines[0] or str(path) in lines[0]
    assert done.stdout == ""
