"""A reused prompt gives what a fresh read gives on a K-quant file (Q4_K_M, on llama.cpp).

llama.cpp computes K-quant weights with a tiled kernel from 8 rows of a batch up and row by
row below, so a prompt read whole and one whose last 1 to 7 tokens were read apart give
logits up to ~0.4 apart: a repeated or extended prompt must read at least that many tokens
again (``MIN_REREAD``). The catalog's Qwen2.5-Coder 0.5B (Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0
blocks) is the file; the default model's Q4_1 takes neither kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import edgeinfer
from edgeinfer.generation.results import MIN_REREAD, REUSE_GRANULE
from edgeinfer.model import Model

pytestmark = pytest.mark.model

NAME = "qwen2.5-coder-0.5b-instruct"
TEXT = (
    "A lighthouse keeper counts the ships that pass each night, writes their names in a "
    "ledger, and trims the wick before dawn; in winter the storms come from the north. "
) * 4


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the gguf extra)")
    with edgeinfer.load(NAME, engine="llama.cpp", context_length=512, threads=2) as m:
        yield m


def _first(model: Model, ids: list[int]) -> tuple[list[int], list[tuple[int, float]]]:
    result = model.generate(ids, max_new_tokens=6, temperature=0, top_logprobs=5)
    assert result.logprobs, "the reply carries its log-probabilities"
    return list(result.token_ids), list(result.logprobs[0].top)


# prompt lengths whose tail past the last multiple of 32 is 2, 3, 6 or 7 tokens: read again
# from there alone, their last batch would be under 8 rows
@pytest.mark.parametrize("length", [66, 67, 70, 71, 98, 103])
def test_a_repeated_prompt_reads_as_it_did_fresh(model: Model, length: int) -> None:
    ids = model.tokenize(TEXT, add_special=False)
    assert len(ids) > length
    prompt = ids[:length]
    model.generate(ids[length:][:8], max_new_tokens=1, temperature=0)  # nothing in common
    fresh = _first(model, prompt)
    again = model.generate(prompt, max_new_tokens=6, temperature=0, top_logprobs=5)
    reused = again.stats.reused_prompt_tokens
    assert reused > 0 and reused % REUSE_GRANULE == 0
    assert (list(again.token_ids), list(again.logprobs[0].top)) == fresh


def test_an_extended_prompt_reads_as_a_fresh_one(model: Model) -> None:
    """A prompt 5 tokens longer than one read before, ending 6 or 7 tokens past a multiple
    of 32 (a chat's next turn): the old rule reused up to that multiple and read the last 6
    or 7 tokens apart."""
    ids = model.tokenize(TEXT, add_special=False)
    for length in (64 + 7, 96 + 6):
        model.generate(ids[length:][:8], max_new_tokens=1, temperature=0)
        fresh = _first(model, ids[:length])
        model.generate(ids[: length - 5], max_new_tokens=1, temperature=0)  # its prefix first
        grown = model.generate(ids[:length], max_new_tokens=6, temperature=0, top_logprobs=5)
        assert grown.stats.reused_prompt_tokens > 0
        assert (list(grown.token_ids), list(grown.logprobs[0].top)) == fresh


def test_a_read_of_eight_rows_or_more_after_a_cut_equals_the_whole_read(model: Model) -> None:
    """What the rule rests on, at the engine: cut at a multiple of 32, the rest read as one
    batch of 8 rows or more gives the logits of the prompt read whole, bit for bit."""
    backend = model._backend
    ids = model.tokenize(TEXT, add_special=False)
    try:
        for length in (67, 72, 103, 130):
            backend.rewind(0)
            whole = np.array(backend.prefill(ids[:length])).copy()
            for cut in range(REUSE_GRANULE, length - MIN_REREAD + 1, REUSE_GRANULE):
                backend.rewind(cut)
                apart = np.array(backend.prefill(ids[cut:length]))
                assert np.array_equal(whole, apart), (length, cut)
    finally:
        backend.rewind(0)
        model._history.clear()
