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
from edgeinfer import InvalidRequestError
from edgeinfer.generation.speculative import parse_speculative

from . import ggufgen
from .test_serve import Server, _start

pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
# ggufgen.tiny_llama's end token (256 byte tokens, 10 merges, then it): banned, so that every
# reply runs its max_tokens and prompt lookup has tokens to draft for
EOS_BAN = {"266": -100}
# a template that gives the messages' text as it is: a chat is then the prompt lookup reads
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def write_tiny(path: Path) -> Path:
    """The tiny random Llama (seed 5) with a chat template, so that chat and responses run."""
    model = ggufgen.tiny_llama(seed=5)
    model.metadata["tokenizer.chat_template"] = ggufgen.Value(ggufgen.STRING, TEMPLATE)
    return model.write(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("spec-serve") / "t.gguf")


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Server]:
    yield from _start(tiny, "--speculative", "auto")


def _completion(server: Server, **extra: Any) -> Any:
    return server.client().completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
        logit_bias=EOS_BAN, extra_body=extra or None,
    )  # fmt: skip


def test_replies_with_and_without_speculation_are_the_same(server: Server, tiny: Path) -> None:
    plain = _completion(server, speculative="off")
    drafted = _completion(server, speculative="lookup")
    default = _completion(server)  # the server's --speculative auto
    assert drafted.choices[0].text == plain.choices[0].text == default.choices[0].text
    with edgeinfer.load(tiny, context_length=256, threads=1) as model:
        local = model.generate(PROMPT, max_new_tokens=24, temperature=0, logit_bias={266: -100})
    assert plain.choices[0].text == local.text
    assert local.finish_reason == "length"  # a whole reply compared, not its first tokens


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
# settings the model runs, and near misses of them
SETTINGS = st.sampled_from(
    ["off", "auto", "lookup", "lookup:1", "lookup:16", "lookup:0", "lookup:17", "lookup:",
     "Lookup", "auto ", "draft:other", "draft:other:4", "draft:", "on", ""]
)  # fmt: skip


def runs(value: object) -> bool:
    """Whether a model loaded without a draft model runs ``value`` (None: the field left out,
    as a null field is read); a request naming a draft model it was not loaded with cannot."""
    if value is None:
        return True
    try:
        return parse_speculative(value).method != "draft"
    except InvalidRequestError:
        return False


def sendable(value: object) -> bool:
    """Whether ``value`` is strict JSON in UTF-8 (no NaN or infinity, no lone surrogate)."""
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except ValueError:  # UnicodeEncodeError among them
        return False
    return True


@given(value=SETTINGS | JSON)
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_any_json_value_is_an_answer_or_a_typed_400(app_client: Any, value: object) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "speculative": value}  # fmt: skip
    reply = app_client.post("/v1/chat/completions", content=json.dumps(body))
    if not sendable(value):  # NaN, a lone surrogate: the body itself is refused
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"
        return
    if runs(value):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"] == "speculative", error


def test_the_server_answers_after_hostile_values(server: Server) -> None:
    for value in ["\x00" * 5000, "lookup:" + "9" * 4000, "\ud800", "auto" * 1000]:
        with pytest.raises(Exception):  # noqa: B017 (any client error: the process stays up)
            _completion(server, speculative=value)
    assert server.process.poll() is None
    assert _completion(server).choices[0].finish_reason in ("stop", "length")
