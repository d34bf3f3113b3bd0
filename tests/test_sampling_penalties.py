"""frequency_penalty and presence_penalty: OpenAI's meaning, over the reply's tokens so far."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer import InvalidRequestError, SamplingConfig
from edgeinfer.generation.sampling import Sampler

VOCAB = 50


def _reference(logits: np.ndarray, generated: list[int], freq: float, pres: float) -> np.ndarray:
    """OpenAI's formula, written out token by token."""
    out = logits.astype(np.float64).copy()
    for token, count in Counter(generated).items():
        out[token] -= count * freq + (1.0 if count > 0 else 0.0) * pres
    return out


@given(
    logits=st.lists(st.floats(-20, 20, width=32), min_size=VOCAB, max_size=VOCAB),
    generated=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    freq=st.floats(-2, 2),
    pres=st.floats(-2, 2),
)
@settings(max_examples=60, deadline=None)
def test_greedy_pick_matches_openais_formula(
    logits: list[float], generated: list[int], freq: float, pres: float
) -> None:
    x = np.asarray(logits, dtype=np.float32)
    config = SamplingConfig(temperature=0, frequency_penalty=freq, presence_penalty=pres)
    sampler = Sampler(config, VOCAB)
    # fed one token at a time, as the generation loop grows the reply
    for n in range(len(generated) + 1):
        picked = sampler(x, generated[:n], generated[:n])
        expected = _reference(x, generated[:n], freq, pres)
        assert expected[picked] >= expected.max() - 1e-4
    assert np.array_equal(x, np.asarray(logits, dtype=np.float32))  # never written


def test_counts_only_the_reply_not_the_prompt() -> None:
    x = np.zeros(VOCAB, dtype=np.float32)
    x[7] = 1.0
    sampler = Sampler(SamplingConfig(temperature=0, presence_penalty=2.0), VOCAB)
    assert sampler(x, [7, 7, 7], []) == 7  # 7 only in the prompt: untouched
    assert sampler(x, [7, 7, 7, 7], [7]) != 7  # generated once: 1 - 2 < 0


def test_frequency_grows_with_each_repeat() -> None:
    x = np.zeros(VOCAB, dtype=np.float32)
    x[3] = 2.5
    sampler = Sampler(SamplingConfig(temperature=0, frequency_penalty=1.0), VOCAB)
    assert sampler(x, [], [3, 3]) == 3  # 2.5 - 2 > 0
    assert sampler(x, [], [3, 3, 3]) != 3  # 2.5 - 3 < 0


def test_a_banned_token_is_not_picked_under_a_negative_penalty() -> None:
    x = np.zeros(VOCAB, dtype=np.float32)
    config = SamplingConfig(
        temperature=0, frequency_penalty=-2.0, presence_penalty=-2.0, logit_bias={5: -math.inf}
    )
    sampler = Sampler(config, VOCAB)
    assert sampler(x, [], [5] * 30) != 5


@pytest.mark.parametrize(
    "value", [2.0001, -2.5, float("nan"), float("inf"), "1", True, None, [1.0]]
)
@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_out_of_range_values_are_refused_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=name):
        SamplingConfig(**{name: value})


@given(value=st.one_of(st.floats(allow_nan=True), st.integers(), st.text(max_size=3)))
@settings(max_examples=80, deadline=None)
def test_any_value_is_taken_or_refused_cleanly(value: object) -> None:
    try:
        config = SamplingConfig(frequency_penalty=value, presence_penalty=value)
    except InvalidRequestError:
        return
    assert -2 <= config.frequency_penalty <= 2
    x = np.full(VOCAB, 3e38, dtype=np.float32)  # near float32's largest: must stay finite
    token = Sampler(config, VOCAB)(x, [], list(range(VOCAB)) * 3)
    assert 0 <= token < VOCAB


def test_batch_rows_take_the_penalties_and_refuse_them_out_of_range() -> None:
    from edgeinfer.batch.records import parse_line

    base = SamplingConfig()
    row = parse_line(
        b'{"prompt": "a", "frequency_penalty": 1.5, "presence_penalty": -0.5}', 1, base
    )
    assert row.request is not None
    assert (row.request.config.frequency_penalty, row.request.config.presence_penalty) == (
        1.5,
        -0.5,
    )
    bad = parse_line(b'{"prompt": "a", "presence_penalty": 3}', 2, base)
    assert bad.request is None and bad.error is not None
    assert "presence_penalty" in bad.error["message"]


def test_the_cli_flags_reach_the_sampler(tiny_llama_gguf) -> None:
    """Negative penalties (OpenAI allows down to -2) favour what the reply already said: the
    tiny random model's greedy reply then repeats itself far more than without them."""
    import json
    import subprocess
    import sys

    def reply(*extra: str) -> list[int]:
        out = subprocess.run(
            [sys.executable, "-m", "edgeinfer", "run", str(tiny_llama_gguf), "-p", "one two",
             "-n", "24", "--temperature", "0", "--json", *extra],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["token_ids"]

    plain = reply()
    repeating = reply("--frequency-penalty", "-2", "--presence-penalty", "-2")
    assert len(set(repeating)) < len(set(plain))
    bad = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "run", str(tiny_llama_gguf), "-p", "x",
         "--frequency-penalty", "9"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 1 and "frequency_penalty" in bad.stderr
