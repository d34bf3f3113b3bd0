"""Embeddings against hostile input: whatever ``embed`` is given (hypothesis), what a
stranger's encoder folder holds (config values, safetensors headers), what a body to
``/v1/embeddings`` says (hypothesis over the parser; the server in-process and the real
``edgeinfer serve`` with the official openai client), and what a file given to
``edgeinfer embed`` holds (the real process). Each refusal is a typed error (a 400 naming the
field), and the model stays usable."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.embedding.batches import MAX_TEXT_CHARS
from edgeinfer.errors import InvalidRequestError, ModelLoadError
from edgeinfer.files.encoder_folder import read_encoder_folder, read_safetensors

from .bertgen import make_bert_folder

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")
pytest.importorskip("onnx")

DIM = 32
_SLOW = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("home")
    saved = os.environ.get("EDGEINFER_HOME")
    os.environ["EDGEINFER_HOME"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("EDGEINFER_HOME", None)
    else:
        os.environ["EDGEINFER_HOME"] = saved


@pytest.fixture(scope="module")
def folder(home: Path) -> Path:
    return make_bert_folder(home.parent / "bert-hostile", max_seq_length=16)


@pytest.fixture(scope="module")
def model(folder: Path) -> Iterator[edgeinfer.Model]:
    with edgeinfer.load(folder, threads=1) as loaded:
        yield loaded


_values = st.one_of(
    st.text(max_size=60),  # any code points, lone surrogates included
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.binary(max_size=8),
    st.lists(st.text(max_size=3), max_size=2),
)


@_SLOW
@given(texts=st.one_of(st.lists(_values, max_size=6), _values, st.dictionaries(st.text(), _values)))
def test_embed_any_input_is_vectors_or_a_typed_error(model: edgeinfer.Model, texts: Any) -> None:
    try:
        got = model.embed(texts)
    except InvalidRequestError as exc:
        assert "texts" in str(exc)
    else:
        n = 1 if isinstance(texts, str) else len(texts)
        assert got.shape == (n, DIM) and np.isfinite(got).all()
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert model.embed(["still usable"]).shape == (1, DIM)


def test_a_10_mb_input_is_refused_before_any_work_and_the_model_stays_usable(
    model: edgeinfer.Model,
) -> None:
    with pytest.raises(InvalidRequestError, match=r"texts\[1\] has 10,000,000 characters"):
        model.embed(["fine", "x" * 10_000_000])
    with pytest.raises(InvalidRequestError, match="empty"):
        model.embed([])
    # just under the bound: read, truncated at the maximum length
    result = model.embed_detailed(["word " * (MAX_TEXT_CHARS // 5)])
    assert result.truncated == [True] and result.tokens == [16]


# -- a stranger's folder ----------------------------------------------------------------------


_CONFIG_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
_CONFIG_KEYS = st.sampled_from(
    [
        "model_type",
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "max_position_embeddings",
        "vocab_size",
        "layer_norm_eps",
        "hidden_act",
        "type_vocab_size",
        "position_embedding_type",
    ]
)


@_SLOW
@given(changes=st.dictionaries(_CONFIG_KEYS, _CONFIG_VALUES, min_size=1, max_size=3))
def test_any_config_value_is_read_or_refused_with_a_model_load_error(
    tmp_path_factory: pytest.TempPathFactory, folder: Path, changes: dict[str, Any]
) -> None:
    copy = tmp_path_factory.mktemp("cfg")
    for name in ("modules.json", "sentence_bert_config.json"):
        (copy / name).write_bytes((folder / name).read_bytes())
    (copy / "1_Pooling").mkdir()
    pooling = (folder / "1_Pooling" / "config.json").read_bytes()
    (copy / "1_Pooling" / "config.json").write_bytes(pooling)
    for name in ("model.safetensors", "tokenizer.json"):
        (copy / name).symlink_to(folder / name)
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    (copy / "config.json").write_text(json.dumps(config, allow_nan=True))
    try:
        enc = read_encoder_folder(copy)
    except ModelLoadError:
        return
    assert enc.config.hidden_size % enc.config.num_attention_heads == 0
    assert 1 <= enc.max_seq_length <= enc.config.max_position_embeddings


_ENTRY = st.dictionaries(
    st.sampled_from(["dtype", "shape", "data_offsets"]),
    st.one_of(st.sampled_from(["F32", "I64", "Q9"]), st.lists(st.integers(-5, 10**12), max_size=3)),
)
_HEADERS = st.one_of(
    st.binary(max_size=64),
    st.dictionaries(st.text(max_size=4), st.one_of(_ENTRY, st.integers()), max_size=3)
    .map(json.dumps)
    .map(str.encode),
)


@_SLOW
@given(header=_HEADERS)
def test_any_safetensors_header_is_read_or_refused_with_a_model_load_error(
    tmp_path_factory: pytest.TempPathFactory, header: bytes
) -> None:
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    try:
        tensors = read_safetensors(path)
    except ModelLoadError:
        return
    for array in tensors.values():
        assert array.nbytes <= 64


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: (f / "modules.json").write_text("{"),
        lambda f: (f / "modules.json").write_text('[{"type": "x.Pooling", "path": "../../etc"}]'),
        lambda f: (f / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": 1}'),
        lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}"),
        lambda f: (f / "tokenizer.json").write_text("not a tokenizer"),
        lambda f: (f / "config.json").write_text('{"model_type": "llama"}'),
    ],
)
def test_a_damaged_folder_is_a_model_load_error(tmp_path: Path, home: Path, damage: Any) -> None:
    broken = make_bert_folder(tmp_path / "broken")
    damage(broken)
    with pytest.raises(ModelLoadError):
        edgeinfer.load(broken, threads=1)


# -- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(model: edgeinfer.Model) -> Iterator[Any]:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    app = create_app(model, ServerConfig(name="bert"))
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        yield test_client


def test_v1_embeddings_string_list_and_base64(client: Any, model: edgeinfer.Model) -> None:
    one = client.post("/v1/embeddings", json={"input": "hello world", "model": "bert"}).json()
    assert one["object"] == "list" and len(one["data"]) == 1
    want = model.embed("hello world")[0]
    np.testing.assert_allclose(one["data"][0]["embedding"], want, atol=1e-6)
    many = client.post("/v1/embeddings", json={"input": ["a", "hello " * 30]}).json()
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert [d["truncated"] for d in many["data"]] == [False, True]
    assert many["usage"]["prompt_tokens"] == 3 + 16
    b64 = client.post(
        "/v1/embeddings", json={"input": ["a", "b"], "encoding_format": "base64", "dimensions": DIM}
    ).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64["data"]]
    np.testing.assert_allclose(decoded, model.embed(["a", "b"]), atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": ["ok", 5]}, "input[1]"),
        ({"input": [[1, 2, 10**6]]}, "input[0]"),  # an id outside the vocabulary
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "dimensions": True}, "dimensions"),
        ({"input": "x", "model": 3}, "model"),
        ({"input": "x", "temperature": 1}, "temperature"),
        ({"input": ["x"] * 3000}, "input"),
    ],
)
def test_v1_embeddings_bad_fields_are_400_naming_the_field(
    client: Any, body: dict[str, Any], param: str
) -> None:
    reply = client.post("/v1/embeddings", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert client.post("/v1/embeddings", json={"input": "fine"}).status_code == 200


def test_v1_embeddings_huge_and_broken_bodies(client: Any) -> None:
    huge = client.post("/v1/embeddings", content=b'{"input": "' + b"x" * (10 << 20) + b'"}')
    assert huge.status_code == 413
    for raw in (b"{", b"\xff\xfe", b"[1, 2]", b'{"input": "\\ud800"}', b"[" * 10000):
        reply = client.post("/v1/embeddings", content=raw)
        assert reply.status_code == 400, (raw[:20], reply.text)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={"messages": messages})
    assert chat.status_code == 400 and "embedding model" in chat.json()["error"]["message"]
    assert client.post("/v1/embeddings", json={"input": "fine"}).status_code == 200


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5)
)
_BODY_KEYS = st.sampled_from(["input", "model", "encoding_format", "dimensions", "user", "x"])
_BODIES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_BODY_KEYS, inner, max_size=4)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(body=_BODIES)
def test_the_body_parser_takes_a_request_or_names_the_field(body: Any) -> None:
    from edgeinfer.serve import wire
    from edgeinfer.serve.embeddings import parse_embeddings

    try:
        parsed = parse_embeddings(body, DIM)
    except wire.WireError as exc:
        assert exc.status == 400 and exc.message
        assert exc.param is not None or not isinstance(body, dict)
        return
    assert parsed.texts and all(isinstance(t, str) for t in parsed.texts)


def test_v1_embeddings_on_a_generating_model_is_a_400(fake_model: edgeinfer.Model) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    app = create_app(fake_model, ServerConfig(name="fake"))
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        reply = test_client.post("/v1/embeddings", json={"input": "hi"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "model_cannot_embed"


def test_the_real_server_with_the_openai_client(folder: Path, home: Path) -> None:
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from .test_serve import _start

    with edgeinfer.load(folder, threads=1) as local:
        want = local.embed(["hello world", "the cat"])
    server_gen = _start(folder, context=None)
    server = next(server_gen)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        got = client.embeddings.create(model=str(folder), input=["hello world", "the cat"])
        np.testing.assert_allclose([d.embedding for d in got.data], want, atol=1e-6)
        b64 = client.embeddings.create(
            model="default", input="hello world", encoding_format="base64"
        )
        raw = np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4")  # type: ignore[arg-type]
        np.testing.assert_allclose(raw, want[0], atol=1e-6)
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model="default", input=[])
        assert caught.value.body["param"] == "input"  # type: ignore[index]
        for raw in (b"\x00" * 1000, b'{"input": ' + b"[" * 5000, b'{"input": "' + b"y" * 5_000_000):
            httpx.post(f"{server.url}/v1/embeddings", content=raw, timeout=30)
        assert client.embeddings.create(model="default", input="alive").data
    finally:
        next(server_gen, None)  # stops it; asserts a clean exit


# -- the CLI over a hostile file -------------------------------------------------------------


def test_the_cli_over_a_hostile_file_writes_a_record_per_line(
    tmp_path: Path, folder: Path, home: Path
) -> None:
    lines = [
        b'{"text": "ok", "id": "a"}',
        b"\xff\xfe\x00 not utf-8",
        b'{"text": "' + b"z" * (MAX_TEXT_CHARS + 10) + b'"}',
        b"[" * 100000,
        b'{"text": {"nested": 1}}',
        b'{"text": "\\ud800"}',
        b'{"id": true, "text": "fine"}',
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n" + b"x" * (5 * MAX_TEXT_CHARS))  # no final newline
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "embed", str(folder), "-i", str(src), "-o", str(out)],
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.decode().strip().splitlines()[-1].startswith("edgeinfer: 6 line(s)")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 8
    assert [("error" in r) for r in records] == [False, True, True, True, True, True, False, True]
    assert records[6]["id"] == 7 and len(records[6]["embedding"]) == DIM
    assert "Traceback" not in done.stderr.decode()
