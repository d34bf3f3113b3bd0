"""The server's `speculative` field and `serve --speculative`: the same replies as plain
decoding, a typed 400 for a bad value whatever its type, and a server still answering after
hostile values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import edgeinfer

from . import ggufgen
from .test_serve import Server, _start

pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ggufgen.tiny_llama(seed=5).write(tmp_path_factory.mktemp("spec-serve") / "t.gguf")


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Server]:
    yield from _start(tiny, "--speculative", "auto")


def _completion(server: Server, **extra: Any) -> Any:
    return server.client().completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
        logit_bias={"2": -100}, extra_body=extra or None,
    )  # fmt: skip


def test_replies_with_and_without_speculation_are_the_same(server: Server, tiny: Path) -> None:
    plain = _completion(server, speculative="off")
    drafted = _completion(server, speculative="lookup")
    default = _completion(server)  # the server's --speculative auto
    assert drafted.choices[0].text == plain.choices[0].text == default.choices[0].text
    with edgeinfer.load(tiny, context_length=256, threads=1) as model:
        local = model.generate(PROMPT, max_new_tokens=24, temperature=0, logit_bias={2: -100})
    assert plain.choices[0].text == local.text


@pytest.mark.parametrize("value", ["sometimes", "lookup:0", "lookup:99", 3, True, [1], {"a": 1}])
def test_a_bad_value_is_a_400_naming_the_field(server: Server, value: object) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        _completion(server, speculative=value)
    body = caught.value.body if isinstance(caught.value.body, dict) else {}
    assert body.get("param") == "speculative", body


@pytest.fixture(scope="module")
def app_client(tiny: Path) -> Iterator[Any]:
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    with edgeinfer.load(tiny, context_length=256, threads=1) as model:
        yield TestClient(create_app(model, ServerConfig(name="m")), base_url="http://127.0.0.1")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@given(value=JSON)
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_any_json_value_is_an_answer_or_a_typed_400(app_client: Any, value: object) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "speculative": value}  # fmt: skip
    reply = app_client.post("/v1/chat/completions", content=json.dumps(body))
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        assert reply.json()["error"]["type"] == "invalid_request_error"


def test_the_server_answers_after_hostile_values(server: Server) -> None:
    for value in ["\x00" * 5000, "lookup:" + "9" * 4000, "\ud800", "auto" * 1000]:
        with pytest.raises(Exception):  # noqa: B017 (any client error: the process stays up)
            _completion(server, speculative=value)
    assert server.process.poll() is None
    assert _completion(server).choices[0].finish_reason in ("stop", "length")
