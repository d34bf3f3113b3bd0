"""OpenAI's logprobs through `edgeinfer serve` with the official client: chat (whole and
streamed) and text completions, checked against Model.score on the same file in this
process; bad values are a 400 naming the field; hostile values leave the server answering."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import edgeinfer

from .test_serve import Server, _start

openai = pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MESSAGES = [{"role": "user", "content": "Say something about cats."}]


@pytest.fixture(scope="module")
def tiny(tiny_llama_gguf: Path) -> Path:
    return tiny_llama_gguf  # it has a chat template


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Server]:
    yield from _start(tiny)


@pytest.fixture(scope="module")
def local(tiny: Path) -> Iterator[edgeinfer.Model]:
    with edgeinfer.load(tiny, context_length=256, threads=1) as model:
        yield model


def test_chat_logprobs_are_the_models_scores(server: Server, local: edgeinfer.Model) -> None:
    reply = server.client().chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=10, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens > 0
    text = b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace")
    assert text.startswith(reply.choices[0].message.content)
    ids = local.chat(MESSAGES, max_new_tokens=10, temperature=0).token_ids
    prompt = local._chat_ids(MESSAGES)
    want = local.score(prompt, list(ids), top_logprobs=3)
    for got, token, lp, top in zip(content, ids, want.logprobs, want.top, strict=True):
        assert got.logprob == pytest.approx(lp, abs=1e-3)
        assert len(got.top_logprobs) == 3
        assert got.top_logprobs[0].logprob >= got.top_logprobs[-1].logprob
        assert got.top_logprobs[0].logprob == pytest.approx(top[0][1], abs=1e-3)
        assert bytes(got.bytes) == local.token_bytes(token)
        assert bytes(got.bytes).decode("utf-8", "replace") == got.token


def test_streamed_logprobs_equal_the_whole_replys(server: Server) -> None:
    kw = {"model": server.model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
          "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = server.client().chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for chunk in server.client().chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in whole]


def test_completion_logprobs_in_the_legacy_shape(server: Server) -> None:
    reply = server.client().completions.create(
        model=server.model, prompt="the cat sat on", max_tokens=8, temperature=0, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(alts) <= 2 for alts in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = server.client().completions.create(
        model=server.model, prompt="the cat sat on", max_tokens=8, temperature=0
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].text == reply.choices[0].text


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"logprobs": "yes"}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("completion", {"logprobs": 6}, "logprobs"),
        ("completion", {"logprobs": True}, "logprobs"),
        ("completion", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_values_are_400_naming_the_field(
    server: Server, kind: str, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if kind == "chat":
            server.client().chat.completions.create(
                model=server.model, messages=MESSAGES, max_tokens=2, extra_body=fields
            )
        else:
            server.client().completions.create(
                model=server.model, prompt="hi", max_tokens=2, extra_body=fields
            )
    body = caught.value.body if isinstance(caught.value.body, dict) else {}
    assert body.get("param") == param, body


@pytest.fixture(scope="module")
def app_client(local: edgeinfer.Model) -> Any:
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    return TestClient(create_app(local, ServerConfig(name="m")), base_url="http://127.0.0.1")


VALUES = (
    st.none()
    | st.booleans()
    | st.integers(-3, 30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5)
)  # JSON has no NaN or Infinity


@given(logprobs=VALUES, top=VALUES, chat=st.booleans())
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_any_values_are_an_answer_or_a_typed_400(
    app_client: Any, logprobs: object, top: object, chat: bool
) -> None:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 2,
        "logprobs": logprobs,
        "top_logprobs": top,
    }
    if chat:
        body["messages"] = MESSAGES
    else:
        body["prompt"] = "hi"
    reply = app_client.post(
        "/v1/chat/completions" if chat else "/v1/completions", content=json.dumps(body)
    )
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        assert reply.json()["error"]["param"] in ("logprobs", "top_logprobs")
    else:
        choice = reply.json()["choices"][0]
        assert choice["logprobs"] is None or isinstance(choice["logprobs"], dict)


def test_the_server_answers_after_hostile_values(server: Server) -> None:
    import httpx

    for raw in (b'{"logprobs": 1e999}', b'{"top_logprobs": [[[[]]]]}', b'{"logprobs": "\\ud800"}'):
        httpx.post(f"{server.url}/v1/chat/completions", content=raw,
                   headers={"authorization": "Bearer test-key-123"}, timeout=30)  # fmt: skip
    assert server.process.poll() is None
    reply = server.client().completions.create(model=server.model, prompt="hi", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
