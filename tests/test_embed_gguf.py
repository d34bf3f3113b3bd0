"""GGUF embedding models through llama.cpp's embedding mode: a tiny random BERT folder written
in the session and converted to GGUF (converters/gguf/bert.py) gives the same vectors as the
ONNX encoder route on the same weights; pooling comes from the file; truncation is reported;
generate is a clear error; the memory plan applies; hostile headers are typed errors before
llama.cpp reads them. The real all-MiniLM-L6-v2, converted once, is marked ``model``."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.errors import EdgeInferError, MemoryBudgetError, NotAGenerativeModelError
from edgeinfer.files.encoder_folder import read_encoder_folder

from .bertgen import make_bert_folder

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("onnxruntime")

TEXTS = ["hello world", "the cat sat on the mat!", "Hello, World 42?", "日本", "hello " * 40]
_REAL_HOME = os.environ.get("EDGEINFER_HOME")


@pytest.fixture(autouse=True)
def _home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path_factory.getbasetemp() / "home"))


def tiny(tmp: Path, pooling: str = "mean") -> tuple[Path, Path]:
    """A tiny random BERT folder and its GGUF."""
    from edgeinfer.converters.gguf.bert import write_bert_gguf

    folder = make_bert_folder(tmp / f"bert-{pooling}", pooling=pooling)
    gguf = write_bert_gguf(read_encoder_folder(folder), tmp / f"bert-{pooling}.gguf")
    return folder, gguf


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine of each row of ``a`` with the same row of ``b`` (norms divided out, so a
    vector of the right direction but the wrong length does not pass for the same)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def assert_unit(vectors: np.ndarray) -> None:
    """``normalize=True`` vectors: each of L2 norm 1 within 1e-5."""
    norms = np.linalg.norm(vectors.astype(np.float64), axis=1)
    assert np.abs(norms - 1.0).max() <= 1e-5, norms


def assert_same_vectors(got: np.ndarray, want: np.ndarray) -> None:
    """Both routes' vectors: the same shape, every pair at a cosine of at least 0.999."""
    assert got.shape == want.shape
    cosine = cosines(got, want)
    assert cosine.min() >= 0.999, cosine


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny(tmp_path_factory.mktemp("gguf-embed"))


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_the_gguf_route_matches_the_onnx_encoder_on_the_same_weights(
    tmp_path: Path, pooling: str
) -> None:
    folder, gguf = tiny(tmp_path, pooling)
    with edgeinfer.load(gguf, threads=2) as model, edgeinfer.load(folder, threads=2) as ref:
        got, want = model.embed_detailed(TEXTS), ref.embed_detailed(TEXTS)
        raw, raw_want = (m.embed(TEXTS, normalize=False) for m in (model, ref))
        assert model.info["pooling"] == pooling and model.info["backend"] == "llama.cpp"
    assert_unit(got.vectors)
    assert_unit(want.vectors)
    assert_same_vectors(got.vectors, want.vectors)
    # before normalizing: the same directions and the same lengths
    assert_same_vectors(raw, raw_want)
    np.testing.assert_allclose(np.linalg.norm(raw, axis=1), np.linalg.norm(raw_want, axis=1),
                               rtol=1e-3)  # fmt: skip
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), got.vectors,
                               atol=1e-6)  # fmt: skip
    assert got.truncated == want.truncated == [False] * 4 + [True]
    assert got.tokens == want.tokens


def test_batches_and_order_do_not_change_a_vector(tiny_pair: tuple[Path, Path]) -> None:
    with edgeinfer.load(tiny_pair[1], threads=1) as model:
        whole = model.embed(TEXTS, batch_size=5)
        one_by_one = np.stack([model.embed([t])[0] for t in reversed(TEXTS)])[::-1]
    np.testing.assert_allclose(whole, one_by_one, atol=1e-5)


def test_generate_is_a_clear_error_and_the_plan_counts_activations(
    tiny_pair: tuple[Path, Path],
) -> None:
    with edgeinfer.load(tiny_pair[1]) as model:
        with pytest.raises(NotAGenerativeModelError, match="embedding model"):
            model.generate("hello")
        plan = model.info["memory_plan"]
        assert model.info["kind"] == "embedding" and plan["batch_size"] >= 1
        assert plan["compute"] > 0 and plan["context_length"] == 24
        assert model.embed(["still usable"]).shape == (1, 32)
    with pytest.raises(MemoryBudgetError, match="activations"):
        edgeinfer.load(tiny_pair[1], memory_budget="1MB")


# -- hostile headers ----------------------------------------------------------------------------


def patched(gguf: Path, out: Path, key: str, value: int) -> Path:
    """``gguf`` with the uint32 value of ``key`` replaced by ``value``."""
    data = bytearray(gguf.read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUF value type uint32
    struct.pack_into("<I", data, at + 4, value)
    out.write_bytes(bytes(data))
    return out


KEYS = ["pooling_type", "embedding_length", "block_count", "context_length",
        "attention.head_count", "feed_forward_length"]  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(KEYS), st.one_of(st.integers(0, 70), st.integers(0, 2**32 - 1)))
def test_any_claimed_size_or_pooling_loads_or_is_a_typed_error(
    tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory, key: str, value: int
) -> None:
    out = patched(tiny_pair[1], tmp_path_factory.mktemp("h") / "x.gguf", f"bert.{key}", value)
    try:
        model = edgeinfer.load(out)
    except EdgeInferError:
        return
    with model:
        assert model.embed(["hello world"]).shape[0] == 1


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [("pooling_type", 7, "pooling_type=7"), ("embedding_length", 10**9, "embedding_length"),
     ("context_length", 4_000_000, "context_length"), ("pooling_type", 0, "pooling_type=0")],
)  # fmt: skip
def test_a_hostile_header_ends_the_cli_with_one_clear_line(
    tiny_pair: tuple[Path, Path], tmp_path: Path, key: str, value: int, words: str
) -> None:
    out = patched(tiny_pair[1], tmp_path / "bad.gguf", f"bert.{key}", value)
    run = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "embed", str(out)],
        input="hello\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode > 0, run  # an exit, not a signal (llama.cpp never saw the file)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], run.stderr


def test_a_kv_cache_type_on_an_embedding_gguf_is_refused(tiny_pair: tuple[Path, Path]) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "embed", str(tiny_pair[1]), "--kv-dtype", "float16"],
        input="hello\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1 and "has no KV cache" in run.stderr, run.stderr


# -- the real model ----------------------------------------------------------------------------


@pytest.mark.model
def test_all_minilm_as_gguf_matches_the_onnx_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    from edgeinfer.embedding.gguf import derived_encoder_gguf

    if _REAL_HOME:
        monkeypatch.setenv("EDGEINFER_HOME", _REAL_HOME)
    else:
        monkeypatch.delenv("EDGEINFER_HOME")
    texts = ["A quick brown fox.", "Ça coûte 5 €, señor.", "日本語の文章です。", "ok 🎉🚀",
             "naïve café résumé", "word " * 400]  # fmt: skip
    with edgeinfer.load("all-minilm-l6-v2", threads=2) as ref:
        want = ref.embed_detailed(texts)
        folder = read_encoder_folder(Path(ref.info["path"]))
    gguf = derived_encoder_gguf("all-minilm-l6-v2", folder)
    assert derived_encoder_gguf("all-minilm-l6-v2", folder) == gguf  # converted once
    with edgeinfer.load(gguf, threads=2) as model:
        got = model.embed_detailed(texts)
    assert_unit(got.vectors)
    assert_unit(want.vectors)
    assert_same_vectors(got.vectors, want.vectors)
    assert got.truncated == want.truncated == [False] * 5 + [True]


def test_without_the_gguf_package_the_conversion_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgeinfer.converters.gguf.bert import write_bert_gguf
    from edgeinfer.errors import ConversionError

    folder = read_encoder_folder(make_bert_folder(tmp_path / "bert"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ConversionError, match=r"edgeinfer\[convert\]"):
        write_bert_gguf(folder, tmp_path / "bert.gguf")
    assert list(tmp_path.glob("*.gguf")) == []
