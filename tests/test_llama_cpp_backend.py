"""What only the GGUF backend does, on the real default model (marked `model`); the shared
behaviour is in test_backend_conformance.py."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.bench.peers import policy_llama
from edgeinfer.model import Model

from .textcheck import non_ascii_bias, reference_text

pytestmark = pytest.mark.model

PARITY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]

MULTILINGUAL_PROMPTS = [
    "Fruit emoji: 🍎 🍌 🍇",
    "Chinese numbers: 一, 二, 三,",
    "日本語の文:",
    "Café, naïve, résumé, crème brûlée,",
]


@pytest.mark.parametrize("flash_attention", [False, True])
@pytest.mark.parametrize("prompt", PARITY_PROMPTS)
def test_greedy_tokens_equal_llama_cpp_python(
    default_gguf: Path, prompt: str, flash_attention: bool
) -> None:
    """Our loop vs llama-cpp-python's own create_completion, same file, greedy, 64 tokens.

    Both sides at their defaults (flash attention off), and both with it on.
    """
    with edgeinfer.load(default_gguf, flash_attention=flash_attention) as model:
        ours = model.generate(prompt, max_new_tokens=64, temperature=0)
    ref = policy_llama(str(default_gguf), flash_attn=flash_attention, verbose=False)
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
    # byte for byte: our text is llama.cpp's bytes for the same ids, an undecodable byte shown
    # as U+FFFD and a character cut at the end left out; llama-cpp-python's text drops them
    whole = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(ref_all_bytes)
    assert ours.text == whole
    assert ref_all_bytes.decode("utf-8", errors="ignore") == ref_text


@pytest.mark.parametrize("prompt", MULTILINGUAL_PROMPTS)
@pytest.mark.parametrize("max_new_tokens", [31, 32])
def test_stream_joins_to_generate_on_multibyte_answers(
    default_model: Model, prompt: str, max_new_tokens: int
) -> None:
    """ASCII tokens are banned, so the reply is multi-byte text whatever this CPU's kernels
    make of near-ties; every property is checked against this run's own token ids."""
    bias = non_ascii_bias(default_model)
    args = {"max_new_tokens": max_new_tokens, "temperature": 0, "logit_bias": bias}
    result = default_model.generate(prompt, **args)
    chunks = list(default_model.stream(prompt, **args))
    assert result.finish_reason == "length"
    assert (
        "".join(c.text for c in chunks)
        == result.text
        == reference_text(default_model, result.token_ids)
    )
    assert sum(len(c.token_ids) for c in chunks) == len(result.token_ids) == max_new_tokens
    assert any(ord(ch) > 127 for ch in result.text)  # every token has a non-ASCII byte
    for chunk in chunks:
        chunk.text.encode("utf-8")  # no lone surrogates


def test_a_reply_cut_inside_a_character_ends_at_the_last_whole_one(default_model: Model) -> None:
    bias = non_ascii_bias(default_model)
    full = default_model.generate(
        "Emoji party: 🎉🎉", max_new_tokens=32, temperature=0, logit_bias=bias
    )
    ids = list(full.token_ids)
    pieces = [default_model._tokenizer.token_bytes(t) for t in ids]
    # a length at which the bytes so far end inside a character (a lead byte without its rest)
    cuts = [n for n in range(1, len(ids)) if _ends_mid_character(b"".join(pieces[:n]))]
    if not cuts:
        pytest.skip("this machine's reply has no token boundary inside a character")
    result = default_model.generate(
        "Emoji party: 🎉🎉", max_new_tokens=cuts[0], temperature=0, logit_bias=bias
    )
    assert result.finish_reason == "length" and len(result.token_ids) == cuts[0]
    assert not result.text.endswith("\ufffd")
    assert result.text == reference_text(default_model, result.token_ids)


def _ends_mid_character(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return False


def test_stop_strings_on_real_output(default_model: Model) -> None:
    prompt = "Fruit emoji: 🍎 🍌 🍇"
    bias = non_ascii_bias(default_model)
    full = default_model.generate(prompt, max_new_tokens=12, temperature=0, logit_bias=bias)
    text = full.text.replace("\ufffd", "")
    assert len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from this run's reply
    cut = default_model.generate(
        prompt, max_new_tokens=12, temperature=0, stop=[stop], logit_bias=bias
    )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


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
