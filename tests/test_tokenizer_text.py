"""Text the tokenizers cannot take: one rule for every backend (runtimes/base.py's
``tokenizer_text``). A lone surrogate — a Python string can hold ``"\\ud800"``, UTF-8 cannot —
is read as U+FFFD, the replacement character, by llama.cpp's tokenizer and by tokenizer.json's
alike, wherever text enters: prompts, chats, ``tokenize``.

Both backends run the same tiny model (tests/ggufgen.py: the GGUF through llama.cpp, and its
native ONNX graph through ONNX Runtime), so their token ids must agree exactly."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.model import Model
from edgeinfer.runtimes.base import tokenizer_text

from .ggufgen import tiny_llama

pytest.importorskip("llama_cpp")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

CLI = [sys.executable, "-m", "edgeinfer.cli"]
SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
texts = st.lists(
    st.one_of(SURROGATES, st.text(max_size=6), st.sampled_from(["the", " then", "é", "🙂"])),
    max_size=8,
).map("".join)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    root = tmp_path_factory.mktemp("tiny-text")
    gguf = tiny_llama().write(root / "tiny.gguf")
    folder = root / "onnx"
    folder.mkdir()
    write_gguf_folder(gguf, folder, max_context=128)
    return {"gguf": gguf, "onnx": folder}


@pytest.fixture(scope="module")
def models(tiny_files: dict[str, Path]) -> Iterator[dict[str, Model]]:
    opened = {
        kind: edgeinfer.load(path, device="cpu", context_length=128, threads=1)
        for kind, path in tiny_files.items()
    }
    yield opened
    for model in opened.values():
        model.close()


def test_the_rule_replaces_lone_surrogates_only() -> None:
    assert tokenizer_text("a\ud800b\udfffc") == "a\ufffdb\ufffdc"
    assert tokenizer_text("naïve 🙂 \ufffd") == "naïve 🙂 \ufffd"


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=texts)
def test_both_backends_read_lone_surrogates_as_the_replacement_character(
    models: dict[str, Model], text: str
) -> None:
    replaced = text
    for ch in set(text):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            replaced = replaced.replace(ch, "\ufffd")
    ids = {kind: model.tokenize(text) for kind, model in models.items()}
    assert ids["gguf"] == ids["onnx"]
    assert ids["gguf"] == models["gguf"].tokenize(replaced)


@pytest.mark.parametrize("kind", ["gguf", "onnx"])
def test_prompts_and_chats_with_lone_surrogates_generate(
    models: dict[str, Model], kind: str
) -> None:
    model = models[kind]
    text = "the \ud800 then \udc00"
    got = model.generate(text, max_new_tokens=3, temperature=0)
    want = model.generate(tokenizer_text(text), max_new_tokens=3, temperature=0)
    assert got.token_ids == want.token_ids
    assert "".join(c.text for c in model.stream(text, max_new_tokens=3, temperature=0)) == got.text
    model.use_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    reply = model.chat([{"role": "user", "content": text}], max_new_tokens=2, temperature=0)
    assert reply.finish_reason in ("stop", "length")


def test_the_cli_takes_a_prompt_with_a_lone_surrogate(tiny_files: dict[str, Path]) -> None:
    """Both routes, through the real command: argv bytes that are not UTF-8 arrive as lone
    surrogates (surrogateescape) and must not end in a traceback."""
    for path in tiny_files.values():
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "edgeinfer.cli",
                "run",
                str(path),
                "-p",
                b"the \xff then",
                "-n",
                "2",
            ],
            capture_output=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stderr.decode(errors="replace")
        assert b"Traceback" not in out.stderr
