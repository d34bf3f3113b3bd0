"""``/v1/embeddings`` with token-id inputs, on the real ``edgeinfer serve`` process over the
tiny BERT folder: ids of the served vocabulary embed as the text they spell (the reference:
the Python API embedding that text in this process), one list or a list of lists, cut at the
maximum length as text is; ids outside the vocabulary are a 400 naming the range; LangChain's
``OpenAIEmbeddings`` with its defaults (token ids, from tiktoken) given a tokenizer file this
test makes; the model-name 404 carries the same hint as chat's; chat on an embedding server
and embeddings on a generating one answer in HTTP terms."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer

from .bertgen import make_bert_folder, vocabulary
from .test_serve import Server, _start

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")
pytest.importorskip("onnx")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

VOCAB = len(vocabulary())
MAX_LEN = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("home")
    saved = os.environ.get("EDGEINFER_HOME")
    os.environ["EDGEINFER_HOME"] = str(home)
    yield make_bert_folder(home.parent / "bert-ids", max_seq_length=MAX_LEN)
    if saved is None:
        os.environ.pop("EDGEINFER_HOME", None)
    else:
        os.environ["EDGEINFER_HOME"] = saved


@pytest.fixture(scope="module")
def local(folder: Path) -> Iterator[edgeinfer.Model]:
    with edgeinfer.load(folder, threads=1) as model:
        yield model


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[Server]:
    """Answers every model name (as LangChain names OpenAI's models)."""
    yield from _start(folder, "--any-model-name", context=None)


def _client(server: Server) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_ids_embed_as_the_text_they_spell(server: Server, local: edgeinfer.Model) -> None:
    texts = ["hello world", "the cat sat on the mat", "hello " * 30]
    ids = [local.tokenize(t) for t in texts]
    want = local.embed(texts)
    client = _client(server)
    one = client.embeddings.create(model="default", input=ids[0])
    np.testing.assert_allclose(one.data[0].embedding, want[0], atol=1e-5)
    many = client.embeddings.create(model="default", input=ids)
    np.testing.assert_allclose([d.embedding for d in many.data], want, atol=1e-5)
    assert many.usage.prompt_tokens == len(ids[0]) + len(ids[1]) + MAX_LEN
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": ids}, timeout=60).json()
    assert [d["truncated"] for d in raw["data"]] == [False, False, True]
    b64 = client.embeddings.create(model="default", input=ids[:1], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4")  # type: ignore[arg-type]
    np.testing.assert_allclose(decoded, want[0], atol=1e-5)
    assert client.embeddings.create(model="default", input=[[1, 2, 3]]).data  # as reported


@pytest.mark.parametrize(
    ("value", "param", "words"),
    [
        ([[1, 2, 10**6]], "input[0]", f"0 to {VOCAB - 1}"),
        ([1, VOCAB], "input", f"0 to {VOCAB - 1}"),
        ([[1], [-1]], "input[1]", f"0 to {VOCAB - 1}"),
        ([[1], [1.5]], "input[1]", "not a token id"),
        ([[1], [True]], "input[1]", "not a token id"),
        ([[1], []], "input[1]", "empty"),
        ([[1], "text"], "input[1]", "one kind throughout"),
        ([[[1]]], "input[0]", "not a token id"),
        (["text", [1]], "input[1]", "a string"),
        ([[1] * 8193], "input[0]", "more than 8,192"),
    ],
)
def test_bad_ids_are_400_naming_the_input(
    server: Server, value: Any, param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).embeddings.create(model="default", input=value)
    assert info.value.body["param"] == param, info.value.body
    assert words in info.value.body["message"]
    assert _client(server).embeddings.create(model="default", input="alive").data


def _tiny_tiktoken(path: Path) -> Any:
    """A byte-pair file in tiktoken's format whose ids all lie in the tiny model's
    vocabulary: a-z and space, and the merges of "the"; loaded as tiktoken loads its files."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    tokens = [bytes([b]) for b in b"abcdefghijklmnopqrstuvwxyz "] + [b"th", b"the", b" the"]
    assert len(tokens) < VOCAB
    path.write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    )
    return tiktoken.Encoding(
        name="cl100k_base",
        pat_str=r" ?\p{L}+|\s+(?!\S)|\s+",
        mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens={},
    )


def test_langchain_openai_embeddings_with_its_defaults(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LangChain tokenizes with tiktoken's cl100k_base for OpenAI's model names and sends the
    ids: here cl100k_base is the tiny file (OpenAI's own cannot be fetched offline)."""
    pytest.importorskip("langchain_openai")
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    encoding = _tiny_tiktoken(tmp_path / "tiny.tiktoken")
    monkeypatch.setitem(tiktoken.registry.ENCODINGS, "cl100k_base", encoding)
    texts = ["the cat sat", "hello world the end"]
    embedder = OpenAIEmbeddings(
        model="text-embedding-3-small", base_url=f"{server.url}/v1", api_key="x", max_retries=0
    )
    got = embedder.embed_documents(texts)
    ids = [encoding.encode_ordinary(t) for t in texts]
    want = _client(server).embeddings.create(model="text-embedding-3-small", input=ids)
    np.testing.assert_allclose(got, [d.embedding for d in want.data], atol=1e-5)
    # the ids index the served vocabulary, not the text's tokens: another vector than the text's
    with edgeinfer.load(server.model, threads=1) as model:
        assert not np.allclose(got, model.embed(texts), atol=1e-3)


def test_langchain_sending_text_embeds_the_text(server: Server, local: edgeinfer.Model) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(
        model="text-embedding-3-small", base_url=f"{server.url}/v1", api_key="x",
        max_retries=0, check_embedding_ctx_length=False,
    )  # fmt: skip
    texts = ["hello world", "the cat sat on the mat"]
    np.testing.assert_allclose(embedder.embed_documents(texts), local.embed(texts), atol=1e-5)


def _app(model: edgeinfer.Model, **config: Any) -> Any:
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    app = create_app(model, ServerConfig(name="bert", **config))
    return TestClient(app, base_url="http://127.0.0.1")


def test_an_unknown_model_is_the_same_404_on_every_endpoint(
    local: edgeinfer.Model, fake_model: edgeinfer.Model
) -> None:
    body = {"input": "hello", "model": "text-embedding-3-small"}
    embed = _app(local).post("/v1/embeddings", json=body)
    chat_body = {"model": "text-embedding-3-small", "messages": [{"role": "user", "content": "x"}]}
    chat = _app(fake_model).post("/v1/chat/completions", json=chat_body)
    model = _app(local).get("/v1/models/text-embedding-3-small")
    messages = {r.json()["error"]["message"] for r in (embed, chat, model)}
    assert [r.status_code for r in (embed, chat, model)] == [404, 404, 404]
    (message,) = messages
    assert "--any-model-name" in message


def test_chat_on_an_embedding_server_answers_in_http_terms(server: Server) -> None:
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"prompt": "hi"},
        "/v1/responses": {"input": "hi"},
    }
    for path, body in bodies.items():
        reply = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["code"] == "model_cannot_generate"
        assert "POST /v1/embeddings" in error["message"] and "model.embed" not in error["message"]


def test_embeddings_on_a_generating_server_answer_in_http_terms(
    fake_model: edgeinfer.Model,
) -> None:
    reply = _app(fake_model).post("/v1/embeddings", json={"input": "hi"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "model_cannot_embed"
    assert "POST /v1/chat/completions" in error["message"] and "load(" not in error["message"]


_ID_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(0, VOCAB - 1),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
)
_ID_INPUTS = st.one_of(
    st.lists(_ID_VALUES, max_size=6),
    st.lists(st.lists(_ID_VALUES, max_size=5) | _ID_VALUES, max_size=5),
    st.lists(st.integers(0, VOCAB - 1), min_size=8190, max_size=8200),
    st.recursive(st.integers(0, 5), lambda inner: st.lists(inner, max_size=3), max_leaves=10),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_ID_INPUTS)
def test_any_id_input_is_lists_of_ids_in_range_or_a_400_naming_it(value: Any) -> None:
    from edgeinfer.serve import wire
    from edgeinfer.serve.embeddings import parse_embeddings

    try:
        parsed = parse_embeddings({"input": value}, 32, VOCAB)
    except wire.WireError as exc:
        assert exc.status == 400 and exc.param is not None and exc.param.startswith("input")
        assert len(exc.message) < 400
        return
    if parsed.ids is None:
        assert all(isinstance(t, str) for t in parsed.texts)
        return
    assert parsed.ids and all(0 < len(ids) <= 8192 for ids in parsed.ids)
    for ids in parsed.ids:
        assert all(type(t) is int and 0 <= t < VOCAB for t in ids)
