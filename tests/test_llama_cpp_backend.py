"""The GGUF backend on the real default model (marked `model`)."""

from __future__ import annotations

from pathlib import Path

import pytest

import edgeinfer
from edgeinfer import EdgeInferError
from edgeinfer.model import Model
from edgeinfer.runtimes.base import Backend, Tokenizer

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


def test_greedy_answer_names_paris(default_model: Model) -> None:
    result = default_model.generate("The capital of France is", max_new_tokens=16, temperature=0)
    assert "Paris" in result.text


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


def test_seed_reproduces_across_loads(default_gguf: Path) -> None:
    outputs = []
    for _ in range(2):
        with edgeinfer.load(default_gguf, context_length=256) as model:
            outputs.append(
                model.generate(
                    "Tell me a story:", max_new_tokens=24, temperature=0.9, seed=42
                ).token_ids
            )
    assert outputs[0] == outputs[1]


def test_prefix_reuse_gives_the_same_tokens_as_a_fresh_model(default_gguf: Path) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    with edgeinfer.load(default_gguf, context_length=512) as model:
        first = model.chat(messages, max_new_tokens=16, temperature=0)
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And a vegetable?"},
        ]
        second = model.chat(messages, max_new_tokens=16, temperature=0)
    assert second.stats.reused_prompt_tokens > 30
    with edgeinfer.load(default_gguf, context_length=512) as fresh:
        expected = fresh.chat(messages, max_new_tokens=16, temperature=0)
    assert second.token_ids == expected.token_ids


def test_tokenizer_round_trip_and_protocol(default_model: Model) -> None:
    backend = default_model._backend
    assert isinstance(backend, Backend) and isinstance(backend.tokenizer, Tokenizer)
    text = "Hello, wörld! 你好 🙂"
    ids = default_model.tokenize(text)
    assert default_model.detokenize(ids) == text
    assert default_model.tokenize("<|im_start|>", add_special=False) == [1]


def test_info_describes_the_session(default_model: Model) -> None:
    info = default_model.info
    assert info["backend"] == "llama.cpp" and info["format"] == "gguf"
    assert info["context_length"] == 1024 and info["vocab_size"] == 49152
    # 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 1024 tokens x 2 bytes (f16)
    assert info["kv_cache_bytes"] == 2 * 30 * 3 * 64 * 1024 * 2


def test_context_length_limits(default_gguf: Path) -> None:
    with pytest.raises(edgeinfer.InvalidRequestError, match="trained context"):
        edgeinfer.load(default_gguf, context_length=100_000)
    with edgeinfer.load(default_gguf, context_length=32) as model:
        result = model.generate("1, 2, 3, 4, 5,", max_new_tokens=100, temperature=0)
        assert result.finish_reason == "length"
        assert result.stats.prompt_tokens + result.stats.completion_tokens == 32
        with pytest.raises(edgeinfer.InvalidRequestError, match="context"):
            model.generate("word " * 40)


def test_close_is_idempotent_and_later_use_is_an_error(default_gguf: Path) -> None:
    model = edgeinfer.load(default_gguf, context_length=64)
    model.close()
    model.close()
    with pytest.raises(EdgeInferError, match="closed"):
        model.generate("hi")
    with pytest.raises(EdgeInferError, match="closed"):
        model.tokenize("hi")


def test_unavailable_device_says_what_to_install(default_gguf: Path) -> None:
    with pytest.raises(edgeinfer.BackendUnavailableError, match="GPU"):
        edgeinfer.load(default_gguf, device="cuda")
