"""One suite, run against every installed backend on the default model (marked `model`)."""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeinfer
from edgeinfer import EdgeInferError, InvalidRequestError
from edgeinfer.bench.peers import policy_llama
from edgeinfer.model import Model
from edgeinfer.runtimes.base import Backend, Tokenizer

from .textcheck import non_ascii_bias, reference_text

pytestmark = pytest.mark.model

BACKENDS = ["gguf", "onnx"]


@pytest.fixture(params=BACKENDS)
def model_path(request: pytest.FixtureRequest, default_gguf: Path) -> Path:
    if request.param == "gguf":
        return default_gguf
    pytest.importorskip("onnxruntime", reason="needs the onnx extra")
    get: Callable[[str], Path] = request.getfixturevalue("default_onnx")
    return get("fp32")


@pytest.fixture
def model(model_path: Path) -> Iterator[Model]:
    with edgeinfer.load(model_path, context_length=512, threads=2) as m:
        yield m


def test_greedy_answer_equals_a_reference_engine(
    model: Model, model_path: Path, request: pytest.FixtureRequest
) -> None:
    """The same weights through another engine in this run: llama-cpp-python for the GGUF,
    transformers on the checkpoint the ONNX model was converted from."""
    prompt = "The capital of France is"
    result = model.generate(prompt, max_new_tokens=16, temperature=0)
    if model_path.suffix == ".gguf":
        _same_as_llama_cpp(model_path, prompt, result, {}, multibyte=False)
        return
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint: Path = request.getfixturevalue("default_checkpoint")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([model.tokenize(prompt)])
    with torch.no_grad():
        out = reference.generate(ids, max_new_tokens=16, do_sample=False)
    expected = [int(t) for t in out[0, ids.shape[1] :]]
    eos = [i for i, t in enumerate(expected) if model._tokenizer.is_end_of_generation(t)]
    assert list(result.token_ids) == expected[: eos[0] if eos else None]


def test_a_multibyte_greedy_answer_is_llama_cpps_bytes(default_gguf: Path) -> None:
    """ASCII tokens banned, so the reply is multi-byte: the same ids as llama-cpp-python on
    the same file, and our text is its bytes (llama.cpp's own text is the reference, so this
    is the GGUF route's test)."""
    prompt = "Fruit emoji: 🍎 🍌 🍇"
    with edgeinfer.load(default_gguf, context_length=512, threads=2) as model:
        bias = non_ascii_bias(model)
        result = model.generate(prompt, max_new_tokens=16, temperature=0, logit_bias=bias)
    _same_as_llama_cpp(default_gguf, prompt, result, bias, multibyte=True)


def _same_as_llama_cpp(
    path: Path, prompt: str, result: Any, bias: dict[int, float], *, multibyte: bool
) -> None:
    ref = policy_llama(str(path), n_ctx=512, verbose=False)
    try:
        n_prompt = len(ref.tokenize(prompt.encode(), special=True))
        done = ref.create_completion(prompt, max_tokens=16, temperature=0,
                                     logit_bias=bias or None)  # fmt: skip
        # create_completion evaluates every generated token but the last one it returns
        evaluated = [int(t) for t in ref.input_ids[: ref.n_tokens][n_prompt:]]
        ref_bytes = ref.detokenize(list(result.token_ids))
    finally:
        ref.close()
    if not multibyte:  # llama-cpp-python runs past max_tokens to finish a character
        assert len(result.token_ids) == done["usage"]["completion_tokens"]
    shared = min(len(evaluated), len(result.token_ids))
    assert list(result.token_ids[:shared]) == evaluated[:shared]
    assert len(evaluated) >= len(result.token_ids) - 1
    # byte for byte: our text is llama.cpp's bytes for the same ids (an undecodable byte
    # shown as U+FFFD, a character cut at the end left out); llama-cpp-python drops them
    whole = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(ref_bytes)
    assert result.text == whole
    assert done["choices"][0]["text"].startswith(ref_bytes.decode("utf-8", errors="ignore"))


@pytest.mark.parametrize(
    "prompt",
    ["Fruit emoji: 🍎 🍌 🍇", "Chinese numbers: 一, 二, 三,", "Café, naïve, résumé, crème brûlée,"],
)
def test_stream_joins_to_generate(model: Model, prompt: str) -> None:
    # ASCII tokens banned: the answer is multi-byte on any machine, checked against its own ids
    args = {"max_new_tokens": 24, "temperature": 0, "logit_bias": non_ascii_bias(model)}
    result = model.generate(prompt, **args)
    chunks = list(model.stream(prompt, **args))
    assert "".join(c.text for c in chunks) == result.text == reference_text(model, result.token_ids)
    assert any(ord(ch) > 127 for ch in result.text)  # every token has a non-ASCII byte
    for chunk in chunks:
        chunk.text.encode("utf-8")


def test_repeated_prompt_gives_the_same_tokens(model: Model) -> None:
    prompt = (
        "Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "walked down to the harbour every morning to look at the boats and the gulls, and "
        "counted them twice before he went home"
    )  # over 32 + MIN_REREAD tokens: reuse ends at a multiple of 32
    first = model.generate(prompt, max_new_tokens=24, temperature=0)
    again = model.generate(prompt, max_new_tokens=24, temperature=0)
    assert again.stats.reused_prompt_tokens >= 32
    assert first.token_ids == again.token_ids


def test_chat_reuses_the_conversation(model_path: Path) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    with edgeinfer.load(model_path, context_length=512) as model:
        first = model.chat(messages, max_new_tokens=12, temperature=0)
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And a vegetable?"},
        ]
        second = model.chat(messages, max_new_tokens=12, temperature=0)
    assert second.stats.reused_prompt_tokens > 30


def test_seed_reproduces_across_loads(model_path: Path) -> None:
    outputs = []
    for _ in range(2):
        with edgeinfer.load(model_path, context_length=256) as model:
            outputs.append(
                model.generate(
                    "Tell me a story:", max_new_tokens=16, temperature=0.9, seed=42
                ).token_ids
            )
    assert outputs[0] == outputs[1]


def test_rewind_then_prefill_matches_one_prefill(model: Model) -> None:
    backend = model._backend
    ids = model.tokenize("The quick brown fox jumps over the lazy dog")
    model._history.tokens = []
    backend.rewind(0)
    whole = np.array(backend.prefill(ids))
    backend.rewind(4)
    assert backend.n_past == 4
    again = np.array(backend.prefill(ids[4:]))
    backend.rewind(0)
    np.testing.assert_allclose(again, whole, atol=1e-3)
    assert int(again.argmax()) == int(whole.argmax())


def test_protocol_and_info(model: Model) -> None:
    backend = model._backend
    assert isinstance(backend, Backend) and isinstance(backend.tokenizer, Tokenizer)
    info = model.info
    for key in ("backend", "provider", "device", "threads", "context_length", "kv_cache_bytes"):
        assert key in info, key
    assert info["context_length"] == 512 and info["vocab_size"] == 49152
    # 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 512 tokens x bytes per element
    assert info["kv_cache_bytes"] in (2 * 30 * 3 * 64 * 512 * 2, 2 * 30 * 3 * 64 * 512 * 4)


def test_tokenizer_round_trip(model: Model) -> None:
    text = "Hello, wörld! 你好 🙂"
    assert model.detokenize(model.tokenize(text)) == text
    assert model.tokenize("<|im_start|>", add_special=False) == [1]


def test_context_limits(model_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="trained context"):
        edgeinfer.load(model_path, context_length=100_000)
    with edgeinfer.load(model_path, context_length=32) as model:
        result = model.generate("1, 2, 3, 4, 5,", max_new_tokens=100, temperature=0)
        assert result.finish_reason == "length"
        assert result.stats.prompt_tokens + result.stats.completion_tokens == 32
        with pytest.raises(InvalidRequestError, match="context"):
            model.stream("word " * 40)


def test_close_is_idempotent(model_path: Path) -> None:
    model = edgeinfer.load(model_path, context_length=64)
    model.close()
    model.close()
    with pytest.raises(EdgeInferError, match="closed"):
        model.generate("hi")


def test_eight_threads_ten_requests_each(model: Model) -> None:
    prompts = [f"List {n} things about the number {n}:" for n in range(8)]
    expected = {p: model.generate(p, max_new_tokens=6, temperature=0).token_ids for p in prompts}
    results: dict[str, list[tuple[int, ...]]] = {p: [] for p in prompts}
    failures: list[BaseException] = []

    def worker(prompt: str) -> None:
        try:
            for _ in range(10):
                out = model.generate(prompt, max_new_tokens=6, temperature=0).token_ids
                results[prompt].append(out)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert all(outs == [expected[p]] * 10 for p, outs in results.items())


def test_cancel_mid_stream_then_generate_equals_a_fresh_model(model_path: Path) -> None:
    prompt = "Write a poem about the sea:"
    with edgeinfer.load(model_path, context_length=256) as fresh:
        expected = fresh.generate(prompt, max_new_tokens=24, temperature=0).token_ids
    with edgeinfer.load(model_path, context_length=256) as model:
        ban_eos = {t: -100.0 for t in range(3)}  # SmolLM2's special tokens: keep it talking
        stream = model.stream(
            "Tell me about mountains.", max_new_tokens=100, temperature=0, logit_bias=ban_eos
        )
        for i, _chunk in enumerate(stream):
            if i == 5:
                stream.cancel()
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
        assert model.generate(prompt, max_new_tokens=24, temperature=0).token_ids == expected


def test_fourth_chat_turn_equals_a_fresh_model(model_path: Path) -> None:
    """Reusing the conversation's cache gives exactly what reading it from scratch gives."""
    messages = [{"role": "system", "content": "You are a helpful assistant. Be brief."}]
    questions = ["Name a river.", "Which country is it in?", "Is it long?", "Name another."]
    with edgeinfer.load(model_path, context_length=1024) as model:
        for question in questions[:3]:
            messages.append({"role": "user", "content": question})
            reply = model.chat(messages, max_new_tokens=24, temperature=0)
            messages.append({"role": "assistant", "content": reply.text})
        messages.append({"role": "user", "content": questions[3]})
        reused = model.chat(messages, max_new_tokens=24, temperature=0)
    with edgeinfer.load(model_path, context_length=1024) as fresh:
        expected = fresh.chat(messages, max_new_tokens=24, temperature=0)
    assert reused.stats.reused_prompt_tokens > reused.stats.prompt_tokens // 2
    assert reused.token_ids == expected.token_ids
