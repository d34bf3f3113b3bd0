"""A request's greedy reply, and its sampled reply under a seed, does not depend on what runs
beside it, on either route of the default model: 16 prompts, each alone in a one-slot model
and in batches of 1, 2, 4 and 8 on an eight-slot model of the same file, compared token id
for token id.

llama.cpp gives each slot its own KV stream and per-row kernels. On the ONNX route every step
of two or more rows computes each row as a step of any other number of rows does; a lone
sequence's step is one row where this CPU computes it the same way, else paired with a spare
row (``runtimes/onnx_slots.py``, probed at load).
"""

from __future__ import annotations

from typing import Any

import pytest

import edgeinfer
from edgeinfer.files.catalog import DEFAULT_MODEL

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the gguf extra)")
pytest.importorskip("onnxruntime")

PROMPTS = [
    "Water boils at",
    "The capital of France is",
    "def fibonacci(n):",
    "Hi",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Explain recursion in one sentence.",
    "What is 17 times 3?",
    "import numpy as np\n",
    "Dear customer, your order",
    "The three primary colours are",
    "SELECT name FROM users WHERE",
    "In 1969, the first person to walk on the moon was",
    "A haiku about autumn leaves:\n",
    "Translate to French: good morning",
    "Once upon a time, in a small village,",
]
NEW = 32  # tokens per reply, the end of generation banned: every reply runs them all


def _requests(sampling: str) -> list[dict[str, Any]]:
    """Each prompt as a request: greedy, or sampled under a seed of its own."""
    if sampling == "greedy":
        return [{"prompt": p, "temperature": 0} for p in PROMPTS]
    return [{"prompt": p, "temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
            for i, p in enumerate(PROMPTS)]  # fmt: skip


@pytest.mark.model
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("engine", ["llama.cpp", "onnxruntime"])
def test_default_model_replies_are_the_same_alone_and_in_any_batch(
    engine: str, sampling: str
) -> None:
    options: dict[str, Any] = {"engine": engine, "threads": 2, "context_length": 256}
    requests = _requests(sampling)
    with edgeinfer.load(DEFAULT_MODEL, parallel=1, **options) as one:
        assert one.info["backend"] == engine
        vocab = one.info["vocab_size"]
        end = {t: -100.0 for t in range(vocab) if one.is_end_token(t)}
        fixed = {"max_new_tokens": NEW, "logit_bias": end}
        alone = [one.generate(r["prompt"], **fixed, **{k: v for k, v in r.items() if k != "prompt"})
                 .token_ids for r in requests]  # fmt: skip
    assert all(len(ids) == NEW for ids in alone)
    with edgeinfer.load(DEFAULT_MODEL, parallel=8, **options) as many:
        for size in (1, 2, 4, 8):
            got = []
            for start in range(0, len(PROMPTS), size):
                results = many.generate_many(requests[start : start + size], **fixed)
                got += [r.token_ids for r in results]
            differ = [p for p, a, b in zip(PROMPTS, alone, got, strict=True) if a != b]
            assert not differ, f"{engine}, {sampling}, batches of {size}: {differ}"
