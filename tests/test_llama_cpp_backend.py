"""What only the GGUF backend does, on the real default model (marked `model`); the shared
behaviour is in test_backend_conformance.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.model import Model

pytestmark = pytest.mark.model

PARITY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]

# Prompts whose greedy answers contain emoji, CJK and accented text (checked below).
MULTILINGUAL_PROMPTS = {
    "Fruit emoji: 🍎 🍌 🍇": "🍏",
    "Emoji party: 🎉🎉": "🎌",
    "Chinese numbers: 一, 二, 三,": "五",
    "日本語の文:": "パ",
    "In Chinese, hello is 你好 and thank you is": "你好",
    "Café, naïve, résumé, crème brûlée,": "déjà",
}


@pytest.mark.parametrize("flash_attention", [False, True])
@pytest.mark.parametrize("prompt", PARITY_PROMPTS)
def test_greedy_tokens_equal_llama_cpp_python(
    default_gguf: Path, prompt: str, flash_attention: bool
) -> None:
    """Our loop vs llama-cpp-python's own create_completion, same file, greedy, 64 tokens.

    Both sides at their defaults (flash attention off), and both with it on.
    """
    from llama_cpp import Llama

    with edgeinfer.load(default_gguf, flash_attention=flash_attention) as model:
        ours = model.generate(prompt, max_new_tokens=64, temperature=0)
    ref = Llama(str(default_gguf), flash_attn=flash_attention, verbose=False)
    try:
        n_prompt = len(ref.tokenize(prompt.encode(), special=True))
        out = ref.create_completion(prompt, max_tokens=64, temperature=0)
        # create_completion evaluates every generated token but the last one it returns
        ref_evaluated = [int(t) for t in ref.input_ids[: ref.n_tokens][n_prompt:]]
        ref_count = out["usage"]["completion_tokens"]
        ref_text = out["choices"][0]["text"]
        ref_all_bytes = ref.detokenize(list(ours.token_ids))
    finally:
        ref.close()
    assert len(ours.token_ids) == ref_count
    assert list(ours.token_ids[: len(ref_evaluated)]) == ref_evaluated
    assert len(ref_evaluated) >= ref_count - 1
    # llama-cpp-python drops undecodable bytes; we show them as U+FFFD
    assert ours.text.replace("\ufffd", "") == ref_text
    assert ref_all_bytes.decode("utf-8", errors="ignore") == ref_text


@pytest.mark.parametrize("prompt, expected", MULTILINGUAL_PROMPTS.items())
def test_stream_joins_to_generate_on_multibyte_answers(
    default_model: Model, prompt: str, expected: str
) -> None:
    result = default_model.generate(prompt, max_new_tokens=32, temperature=0)
    chunks = list(default_model.stream(prompt, max_new_tokens=32, temperature=0))
    assert expected in result.text  # the answer really is multi-byte text
    assert "".join(c.text for c in chunks) == result.text
    for chunk in chunks:
        chunk.text.encode("utf-8")
    assert all("\ufffd" not in c.text for c in chunks[:-1])


def test_stop_strings_on_real_output(default_model: Model) -> None:
    full = default_model.generate("Fruit emoji: 🍎 🍌 🍇", max_new_tokens=12, temperature=0)
    cut = default_model.generate(
        "Fruit emoji: 🍎 🍌 🍇", max_new_tokens=12, temperature=0, stop=["🍵🍵"]
    )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("🍵🍵")]


def test_unavailable_device_says_what_to_install(default_gguf: Path) -> None:
    with pytest.raises(edgeinfer.BackendUnavailableError, match="GPU"):
        edgeinfer.load(default_gguf, device="cuda")


@pytest.mark.parametrize(
    "prompt", ["Café, naïve, résumé, crème brûlée,", "Water boils at a temperature of"]
)
def test_stop_strings_inside_a_token_and_across_tokens(default_model: Model, prompt: str) -> None:
    full = default_model.generate(prompt, max_new_tokens=24, temperature=0)
    ids = list(full.token_ids)
    bounds = [len(default_model.detokenize(ids[:i])) for i in range(len(ids) + 1)]
    stops = []
    for i in range(2, len(ids) - 1):  # not the first tokens: leave something before the stop
        start, end, after = bounds[i], bounds[i + 1], bounds[i + 2]
        if end - start >= 3 and "\ufffd" not in full.text[start:after]:
            stops.append(full.text[start + 1 : end - 1])  # inside one token
            stops.append(full.text[start + 1 : end + 1])  # from inside one token into the next
            break
    assert stops, f"no multi-character token in {full.text!r}"
    for stop in stops:
        cut_at = full.text.index(stop)
        chunks = list(default_model.stream(prompt, max_new_tokens=24, temperature=0, stop=[stop]))
        text = "".join(c.text for c in chunks)
        assert text == full.text[:cut_at], stop
        assert chunks[-1].finish_reason == "stop"
        assert all("<|" not in c.text for c in chunks)  # no special token text
