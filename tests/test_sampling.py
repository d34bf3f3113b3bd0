from __future__ import annotations

import numpy as np
import pytest

from edgeinfer import InvalidRequestError, SamplingConfig
from edgeinfer.generation.sampling import Sampler

RNG = np.random.default_rng(1234)
LOGITS = RNG.normal(0, 2, size=1000).astype(np.float32)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 1.5),
        ("max_new_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("repetition_penalty", 0),
        ("repetition_penalty", float("nan")),
        ("repetition_window", -1),
        ("seed", -1),
        ("seed", "abc"),
        ("stop", [""]),
        ("stop", [1]),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {"a": 1.0}),
    ],
)
def test_bad_values_are_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingConfig(**{field: value})


def test_unknown_argument_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="temprature"):
        SamplingConfig.from_kwargs(temprature=0.5)


def test_stop_accepts_a_single_string() -> None:
    assert SamplingConfig(stop="\n").stop == ("\n",)
    assert SamplingConfig(stop=["a", "b"]).stop == ("a", "b")


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = LOGITS.copy()
    logits.flags.writeable = False  # an engine-owned view may be read-only
    assert Sampler(SamplingConfig(temperature=0), 1000)(logits) == int(np.argmax(LOGITS))
    biased = Sampler(SamplingConfig(temperature=0, logit_bias={7: 100.0}), 1000)
    assert biased(logits) == 7
    assert np.array_equal(logits, LOGITS)


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(temperature=1.0, top_k=1, top_p=1.0),
        SamplingConfig(temperature=1.0, top_k=None, top_p=1e-6),
        SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.999),
        SamplingConfig(temperature=1e-4, top_k=None, top_p=1.0),
    ],
)
def test_filters_that_keep_one_token_are_greedy(config: SamplingConfig) -> None:
    sampler = Sampler(config, 1000)
    assert {sampler(LOGITS) for _ in range(20)} == {int(np.argmax(LOGITS))}


def test_seed_reproduces_and_differs() -> None:
    def draw(seed: int) -> list[int]:
        sampler = Sampler(SamplingConfig(temperature=1.0, top_k=None, top_p=1.0, seed=seed), 1000)
        return [sampler(LOGITS) for _ in range(50)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_top_k_draws_only_from_the_k_best() -> None:
    sampler = Sampler(SamplingConfig(temperature=5.0, top_k=5, top_p=1.0, seed=0), 1000)
    best = set(np.argsort(-LOGITS)[:5].tolist())
    seen = {sampler(LOGITS) for _ in range(300)}
    assert seen <= best and len(seen) > 1


def test_top_p_keeps_the_smallest_set_holding_the_mass() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=None, top_p=0.7, seed=0), 4)
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def test_top_p_beyond_the_first_candidate_guess() -> None:
    flat = np.zeros(1000, dtype=np.float32)  # uniform: the nucleus of 0.5 is 500 tokens
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=None, top_p=0.5, seed=0), 1000)
    assert len({sampler(flat) for _ in range(3000)}) > 300


def test_min_p_cuts_unlikely_tokens() -> None:
    logits = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=None, top_p=1.0, min_p=0.4, seed=0), 3)
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def test_draw_frequencies_follow_the_distribution() -> None:
    probs = np.array([0.5, 0.25, 0.125, 0.125])
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=None, top_p=1.0, seed=3), 4)
    counts = np.bincount(
        [sampler(np.log(probs).astype(np.float32)) for _ in range(8000)], minlength=4
    )
    assert np.allclose(counts / 8000, probs, atol=0.02)


def test_repetition_penalty_lowers_a_repeated_token() -> None:
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    plain = Sampler(SamplingConfig(temperature=0), 3)
    penalised = Sampler(SamplingConfig(temperature=0, repetition_penalty=1.5), 3)
    assert plain(logits, [0]) == 0
    assert penalised(logits, [0]) == 1
    assert penalised(logits, [0] + [2] * 64) == 0  # token 0 is outside the 64-token window


def test_logit_bias_id_outside_vocabulary_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        Sampler(SamplingConfig(logit_bias={5000: 1.0}), 1000)
