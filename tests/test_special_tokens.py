"""Which tokens are text: decided per token type (runtimes.base.TOKEN_TEXT_RULE), the same way
for every GGUF token type and for tokenizer.json's added tokens, on the tiny Llama (byte-level
BPE) and Gemma 3 (SentencePiece, user-defined markers) models of both backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.model import Model
from edgeinfer.runtimes.base import is_marker

pytest.importorskip("transformers", reason="needs the convert extra")

# GGUF token types (llama.cpp / the gguf package)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _gguf_vocab(path: Path) -> list[tuple[str, int]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    types = reader.fields["tokenizer.ggml.token_type"]
    texts = [bytes(tokens.parts[i]).decode("utf-8") for i in tokens.data]
    return list(zip(texts, (int(types.parts[i][0]) for i in types.data), strict=True))


def _loaded(request: pytest.FixtureRequest) -> Iterator[tuple[Model, Path]]:
    path: Path = request.getfixturevalue(request.param)
    with edgeinfer.load(path, context_length=128, threads=1) as model:
        yield model, path


gguf_model = pytest.fixture(params=["tiny_llama_gguf", "tiny_gemma_gguf"], scope="module")(_loaded)
onnx_model = pytest.fixture(params=["tiny_llama_onnx", "tiny_gemma_onnx"], scope="module")(_loaded)


def test_every_gguf_token_type_follows_the_rule(gguf_model: tuple[Model, Path]) -> None:
    model, path = gguf_model
    seen = set()
    for token, (text, kind) in enumerate(_gguf_vocab(path)):
        data = model._tokenizer.token_bytes(token)
        seen.add(kind)
        if kind in (CONTROL, UNKNOWN, UNUSED) or (kind == USER_DEFINED and is_marker(text)):
            assert data == b"", (token, text, kind)
        elif kind == BYTE:
            assert len(data) == 1, (token, text)
        else:
            assert data, (token, text, kind)  # normal and user-defined text tokens are text
            if kind == USER_DEFINED:
                assert data.decode() == text
    assert {NORMAL, CONTROL} <= seen


def test_gemma_user_defined_markers_are_hidden_and_html_tags_are_text(
    tiny_gemma_gguf: Path,
) -> None:
    vocab = _gguf_vocab(tiny_gemma_gguf)
    kinds = {text: kind for text, kind in vocab}
    assert kinds["<start_of_image>"] == USER_DEFINED and kinds["<table>"] == USER_DEFINED
    with edgeinfer.load(tiny_gemma_gguf, context_length=128, threads=1) as model:
        ids = {text: i for i, (text, _) in enumerate(vocab)}
        marker, table = ids["<start_of_image>"], ids["<table>"]
        # the model is pushed to emit the marker: it never shows in the text
        result = model.generate(
            "Hello", max_new_tokens=6, temperature=0, logit_bias={marker: 100.0}
        )
        assert marker in result.token_ids and "<start_of_image>" not in result.text
        chunks = list(
            model.stream("Hello", max_new_tokens=6, temperature=0, logit_bias={marker: 100.0})
        )
        assert all("<start_of_image>" not in c.text for c in chunks)
        result = model.generate("Hello", max_new_tokens=3, temperature=0, logit_bias={table: 100.0})
        assert "<table>" in result.text


def test_tokenizer_json_added_tokens_follow_the_rule(onnx_model: tuple[Model, Path]) -> None:
    from tokenizers import Tokenizer

    model, path = onnx_model
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    added = tok.get_added_tokens_decoder()
    assert added
    for token, info in added.items():
        data = model._tokenizer.token_bytes(int(token))
        if info.special or is_marker(info.content):
            assert data == b"", info.content
        else:
            assert data.decode() == info.content
    result = model.generate(
        "Hello",
        max_new_tokens=6,
        temperature=0,
        logit_bias={int(t): 100.0 for t in list(added)[:1]},
    )
    assert not any(info.content in result.text for info in added.values() if info.special)
