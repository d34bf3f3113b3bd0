"""`edgeinfer serve` options for clients in the wild, on a real server process driven by the
official `openai` client: frequency/presence penalties, --sampling-defaults and
--any-model-name. Replies are compared with the Python API on the same file, fresh."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import edgeinfer

from .test_serve import CONTEXT, KEY, Server, _start

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
BAN_EOS = {"2": -100}  # the tiny model's end of generation: every reply runs its length
NO_EOS = {2: float("-inf")}


@pytest.fixture(scope="module")
def openai_server(tiny_llama_gguf: Path) -> Iterator[Server]:
    """OpenAI's sampling defaults, and any model name answered."""
    extra = ("--api-key", KEY, "--sampling-defaults", "openai", "--any-model-name")
    yield from _start(tiny_llama_gguf, *extra)


@pytest.fixture(scope="module")
def plain_server(tiny_llama_gguf: Path) -> Iterator[Server]:
    """The defaults: edgeinfer's sampling, 404 for another model name."""
    yield from _start(tiny_llama_gguf, "--api-key", KEY)


@pytest.fixture(scope="module")
def local(tiny_llama_gguf: Path) -> Iterator[edgeinfer.Model]:
    with edgeinfer.load(tiny_llama_gguf, context_length=CONTEXT, threads=1) as model:
        yield model


def _chat(server: Server, **fields: object) -> object:
    fields.setdefault("model", "default")
    return server.client().chat.completions.create(
        messages=MESSAGES, max_tokens=24, logit_bias=BAN_EOS, **fields
    )


@pytest.mark.parametrize(
    "penalties",
    [{"frequency_penalty": 2.0}, {"presence_penalty": 1.5}, {"frequency_penalty": -2.0}],
)
def test_penalties_match_the_python_api(
    plain_server: Server, local: edgeinfer.Model, penalties: dict[str, float]
) -> None:
    reply = _chat(plain_server, temperature=0, **penalties)
    want = local.chat(MESSAGES, temperature=0, max_new_tokens=24, logit_bias=NO_EOS, **penalties)
    assert reply.choices[0].message.content == want.text
    plain = local.chat(MESSAGES, temperature=0, max_new_tokens=24, logit_bias=NO_EOS)
    if penalties.get("frequency_penalty", 0) > 0:  # the tiny model repeats itself unpenalised
        assert want.token_ids != plain.token_ids


@pytest.mark.parametrize("value", [2.5, -3, "1", True, [0]])
@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_out_of_range_penalties_are_400_naming_the_field(
    plain_server: Server, name: str, value: object
) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": MESSAGES, "max_tokens": 2, name: value}
    r = httpx.post(f"{plain_server.url}/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name
    r = httpx.post(
        f"{plain_server.url}/v1/completions",
        content=b'{"prompt": "a", "' + name.encode() + b'": 1e999}',
        headers=headers,
    )
    assert r.status_code == 400
    assert plain_server.process.poll() is None


def test_fields_left_out_take_edgeinfers_defaults(
    plain_server: Server, local: edgeinfer.Model
) -> None:
    reply = _chat(plain_server, seed=11)
    want = local.chat(MESSAGES, seed=11, max_new_tokens=24, logit_bias=NO_EOS)  # SamplingConfig's
    assert reply.choices[0].message.content == want.text


def test_fields_left_out_take_openais_defaults_when_asked(
    openai_server: Server, local: edgeinfer.Model
) -> None:
    reply = _chat(openai_server, seed=11)
    want = local.chat(
        MESSAGES, seed=11, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24, logit_bias=NO_EOS
    )
    assert reply.choices[0].message.content == want.text


def test_another_model_name_is_404_by_default(plain_server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _chat(plain_server, model="gpt-4o", temperature=0)
    assert "--any-model-name" in info.value.body["message"]


def test_any_model_name_answers_with_the_served_model(
    openai_server: Server, local: edgeinfer.Model, tiny_llama_gguf: Path
) -> None:
    client = openai_server.client()
    reply = _chat(openai_server, model="gpt-4o", temperature=0)
    want = local.chat(MESSAGES, temperature=0, max_new_tokens=24, logit_bias=NO_EOS)
    assert reply.choices[0].message.content == want.text
    assert reply.model == str(tiny_llama_gguf)  # the reply names the model that answered
    stream = client.completions.create(
        model="text-davinci-003", prompt="Hello", max_tokens=3, temperature=0, stream=True
    )
    assert {chunk.model for chunk in stream} == {str(tiny_llama_gguf)}
    assert [m.id for m in client.models.list().data] == [str(tiny_llama_gguf)]


def test_any_model_name_covers_embeddings(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("tokenizers")
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    from .bertgen import make_bert_folder

    folder = make_bert_folder(tmp_path / "bert", max_seq_length=16)
    body = {"input": "hello", "model": "text-embedding-3-small"}
    with edgeinfer.load(folder, threads=1) as model:
        for any_name, status in ((False, 404), (True, 200)):
            app = create_app(model, ServerConfig(name="bert", any_model_name=any_name))
            with TestClient(app, base_url="http://127.0.0.1") as client:
                r = client.post("/v1/embeddings", json=body)
                assert r.status_code == status, r.text
                if status == 200:
                    assert r.json()["model"] == "bert"
