"""Tiny random-weight models of two families (Llama: byte-level BPE; Gemma 3: SentencePiece,
sliding-window layers) on both backends, checked against transformers on the same weights in
the same run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer

from .tiny_gemma import SLIDING_WINDOW

pytest.importorskip("transformers", reason="needs the convert extra")

TEXTS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, crème brûlée, déjà vu, Straße, ¿Dónde está?",
    "你好世界\uff0c今天天气很好。こんにちは、世界\uff01한국어 텍스트",
    "Emoji: 🙂🎉🍎👍🏽 and flags 🇫🇷, tabs\tand\nnew lines  double  spaces 12345",
]
# longer than two sliding windows of the tiny Gemma: the mask must slide in every engine
LONG_PROMPT = " ".join(TEXTS)
# llama.cpp's default f16 KV cache moves the tiny models' logits by up to ~1e-2; a generated
# token counts as agreeing when transformers' logit for it is within this of its maximum
_LOGIT_TOLERANCE = 0.05
_N_NEW = 24
_PIECES = st.sampled_from(
    [*"abcXYZ019 .,!?\t\n", *"éèçñüßœ", *"你好世界こんにちは한국", "🙂", "🎉", "👍🏽", "  "]
)

_FAMILIES = {
    "llama": ("tiny_hf", "tiny_llama_gguf", "tiny_llama_onnx"),
    "gemma3": ("tiny_gemma_hf", "tiny_gemma_gguf", "tiny_gemma_onnx"),
}


def _artifacts(request: pytest.FixtureRequest, family: str) -> tuple[Path, Path, Path]:
    hf, gguf_file, onnx = _FAMILIES[family]
    return (
        request.getfixturevalue(hf),
        request.getfixturevalue(gguf_file),
        request.getfixturevalue(onnx),
    )


@pytest.fixture(scope="module", params=sorted(_FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, Path, Path, Path]:
    return (request.param, *_artifacts(request, request.param))


@pytest.fixture(scope="module")
def reference(family: tuple[str, Path, Path, Path]) -> Iterator[Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family[1], dtype=torch.float32)
    yield model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(family: tuple[str, Path, Path, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(family[1])


def _load(path: Path, context_length: int) -> edgeinfer.Model:
    # one thread: these models are tiny, and llama.cpp's spinning workers crawl on a busy CPU
    return edgeinfer.load(path, context_length=context_length, threads=1)


def _reference_logits(reference: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].numpy()  # [seq, vocab]


def _greedy_agreement(reference: Any, prompt: list[int], generated: list[int]) -> dict[str, Any]:
    """Teacher-forced check of an engine's greedy tokens against transformers: each token's
    reference logit against the reference maximum at that position."""
    logits = _reference_logits(reference, prompt + generated[:-1])[len(prompt) - 1 :]
    chosen = logits[np.arange(len(generated)), generated]
    gaps = logits.max(axis=1) - chosen  # 0 where the engine picked transformers' argmax
    return {"top1": float(np.mean(gaps == 0.0)), "max_gap": float(gaps.max())}


@pytest.mark.parametrize("fmt", ["gguf", "onnx"])
def test_loads_and_generates_greedy_tokens_transformers_agrees_with(
    family: tuple[str, Path, Path, Path], reference: Any, fmt: str
) -> None:
    name, _, gguf_file, onnx = family
    with _load(gguf_file if fmt == "gguf" else onnx, 256) as model:
        assert model.info["format"] == fmt
        prompt = model.tokenize(LONG_PROMPT)
        assert len(prompt) > 2 * SLIDING_WINDOW
        result = model.generate(prompt, temperature=0, max_new_tokens=_N_NEW)
    generated = list(result.token_ids)
    assert generated, f"{name} {fmt}: no tokens"
    figures = _greedy_agreement(reference, prompt, generated)
    assert figures["max_gap"] < _LOGIT_TOLERANCE, f"{name} {fmt}: {figures}"


def test_gemma_gguf_logits_match_transformers_at_every_position(
    tiny_gemma_hf: Path, tiny_gemma_gguf: Path
) -> None:
    """llama.cpp with a float32 KV cache on the gemma3 GGUF: every position of a prompt three
    sliding windows long within 1e-2 of transformers (measured ~2e-3), the same argmax where
    the reference's top two are apart by more than that."""
    import torch
    from transformers import AutoModelForCausalLM

    Llama = pytest.importorskip("llama_cpp", reason="needs the gguf extra").Llama
    reference = AutoModelForCausalLM.from_pretrained(tiny_gemma_hf, dtype=torch.float32).eval()
    f32_cache = 0  # GGML_TYPE_F32
    engine = Llama(str(tiny_gemma_gguf), n_ctx=256, logits_all=True, type_k=f32_cache,
                   type_v=f32_cache, verbose=False)  # fmt: skip
    try:
        ids = engine.tokenize(LONG_PROMPT.encode(), add_bos=True, special=False)
        engine.eval(ids)
        got = np.array(engine.scores[: len(ids)])
    finally:
        engine.close()
    assert len(ids) > 3 * SLIDING_WINDOW
    expected = _reference_logits(reference, ids)
    assert float(np.abs(got - expected).max()) < 1e-2
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2e-2
    assert np.array_equal(got.argmax(1)[clear], expected.argmax(1)[clear])


@pytest.mark.parametrize("fmt", ["gguf", "onnx"])
@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "accents", "cjk", "emoji"])
def test_tokenizer_gives_transformers_ids(
    family: tuple[str, Path, Path, Path], hf_tokenizer: Any, fmt: str, text: str
) -> None:
    _, _, gguf_file, onnx = family
    with _load(gguf_file if fmt == "gguf" else onnx, 64) as model:
        assert model.tokenize(text) == hf_tokenizer.encode(text)
        assert model.tokenize(text, add_special=False) == hf_tokenizer.encode(
            text, add_special_tokens=False
        )
        assert model.detokenize(model.tokenize(text, add_special=False)) == text


@pytest.mark.parametrize("fmt", ["gguf", "onnx"])
def test_tokenizer_agrees_with_transformers_on_generated_text(
    family: tuple[str, Path, Path, Path], hf_tokenizer: Any, fmt: str
) -> None:
    _, _, gguf_file, onnx = family
    with _load(gguf_file if fmt == "gguf" else onnx, 64) as model:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(_PIECES, min_size=1, max_size=30).map("".join))
        def check(text: str) -> None:
            ids = model.tokenize(text, add_special=False)
            assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
            assert model.detokenize(ids) == text

        check()


@pytest.mark.parametrize("fmt", ["gguf", "onnx"])
def test_chat_prompt_is_transformers_template_rendering(
    family: tuple[str, Path, Path, Path], hf_tokenizer: Any, fmt: str
) -> None:
    _, _, gguf_file, onnx = family
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Café? 你好 🙂"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": "Encore"},
    ]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    with _load(gguf_file if fmt == "gguf" else onnx, 128) as model:
        assert model.apply_chat_template(messages) == expected
        result = model.chat(messages, temperature=0, max_new_tokens=4)
        assert result.stats.prompt_tokens > 0


@pytest.mark.parametrize("fmt", ["gguf", "onnx"])
def test_a_reused_prefix_gives_what_an_empty_cache_gives(
    family: tuple[str, Path, Path, Path], fmt: str
) -> None:
    """Another request first, sharing only BOS or half the prompt (more than a sliding window
    behind the end for Gemma 3): the same greedy tokens as a fresh model."""
    _, _, gguf_file, onnx = family
    path = gguf_file if fmt == "gguf" else onnx
    with _load(path, 256) as fresh:
        prompt = fresh.tokenize(LONG_PROMPT)
        expected = fresh.generate(prompt, temperature=0, max_new_tokens=_N_NEW).token_ids
        detour = fresh.tokenize("Monday, Tuesday, Wednesday, Thursday. " * 3, add_special=False)
    for shared in (1, len(prompt) // 2):
        with _load(path, 256) as model:
            model.generate(prompt[:shared] + detour, temperature=0, max_new_tokens=8)
            result = model.generate(prompt, temperature=0, max_new_tokens=_N_NEW)
        reused = result.stats.reused_prompt_tokens
        assert reused <= shared
        assert result.token_ids == expected, f"{fmt}: {reused} of {shared} shared tokens reused"
