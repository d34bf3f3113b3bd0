"""Model.score: the log-probabilities a model gives a continuation, checked against the
logits of one-token steps computed in the same test, on a fake and on both real engines."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer import InvalidRequestError
from edgeinfer.generation.scoring import MAX_TOP_LOGPROBS, log_softmax
from edgeinfer.model import Model

from . import ggufgen
from .fakes import FakeBackend
from .test_speculative import CopyingBackend


def _stepped(backend, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """log-softmax of the logits before each continuation token, one plain step at a time."""
    backend.rewind(0)
    rows = [np.array(backend.prefill(prompt))]
    for t in continuation[:-1]:
        rows.append(np.array(backend.decode(t)))
    backend.rewind(0)
    return log_softmax(np.stack(rows))


@pytest.mark.parametrize("backend", [FakeBackend, CopyingBackend], ids=["steps", "forward"])
def test_scores_are_the_steps_log_probabilities(backend) -> None:
    model = Model(backend(), name="f", path=Path("f"), model_format="fake")
    prompt, continuation = list(b"hello there"), list(b" general kenobi, you are a bold one")
    s = model.score(prompt, continuation, top_logprobs=5)
    want = _stepped(model._backend, prompt, continuation)
    model._history.tokens.clear()
    model._history.batched = 0
    got = np.array(s.logprobs)
    np.testing.assert_allclose(got, want[np.arange(len(continuation)), continuation], atol=1e-6)
    for row, top in zip(want, s.top, strict=True):
        assert [i for i, _ in top] == list(np.argsort(-row, kind="stable")[:5])
        assert all(a >= b for (_, a), (_, b) in itertools.pairwise(top))
    assert s.token_ids == tuple(continuation) and s.total == pytest.approx(got.sum())
    assert np.all(got <= 0)


@pytest.mark.parametrize("backend", [FakeBackend, CopyingBackend], ids=["steps", "forward"])
def test_rows_are_every_places_whole_distribution(backend) -> None:
    model = Model(backend(), name="f", path=Path("f"), model_format="fake")
    prompt, continuation = list(b"the rows "), list(b"of a reply")
    assert model.score(prompt, continuation).rows is None
    s = model.score(prompt, continuation, top_logprobs=3, rows=True)
    assert s.rows is not None and s.rows.shape == (len(continuation), model.info["vocab_size"])
    want = _stepped(model._backend, prompt, continuation)
    model._history.tokens.clear()
    model._history.batched = 0
    np.testing.assert_allclose(s.rows, want, atol=1e-6)
    np.testing.assert_allclose(np.exp(s.rows).sum(-1), 1.0, atol=1e-9)
    assert [float(s.rows[i, t]) for i, t in enumerate(continuation)] == list(s.logprobs)
    with pytest.raises(InvalidRequestError, match="rows"):
        model.score(prompt, continuation, rows="yes")  # type: ignore[arg-type]


def test_end_tokens_are_the_tokenizers_and_ids_are_checked() -> None:
    model = Model(FakeBackend(), name="f", path=Path("f"), model_format="fake")
    tokenizer = model._backend.tokenizer
    vocab = model.info["vocab_size"]
    assert [t for t in range(vocab) if model.is_end_token(t)] == [
        t for t in range(vocab) if tokenizer.is_end_of_generation(t)
    ]
    assert any(model.is_end_token(t) for t in range(vocab))
    for bad in (-1, vocab, "1", 1.0):
        with pytest.raises(InvalidRequestError):
            model.is_end_token(bad)  # type: ignore[arg-type]


def test_the_cache_after_scoring_serves_the_next_request_as_a_fresh_one() -> None:
    fresh = Model(CopyingBackend(), name="a", path=Path("a"), model_format="fake")
    used = Model(CopyingBackend(), name="b", path=Path("b"), model_format="fake")
    used.score("abc abc abc", " abc abc")
    for prompt in ("abc abc abc", "abc abd", "zzz"):
        a = fresh.generate(prompt, max_new_tokens=12, temperature=0)
        b = used.generate(prompt, max_new_tokens=12, temperature=0)
        assert a.token_ids == b.token_ids


@given(st.one_of(st.integers(-5, 40), st.floats(), st.text(max_size=4), st.none(), st.booleans()))
@settings(max_examples=120, deadline=None)
def test_top_logprobs_out_of_range_or_of_another_type_is_refused(value: object) -> None:
    model = Model(FakeBackend(), name="f", path=Path("f"), model_format="fake")
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP_LOGPROBS
    if ok:
        assert len(model.score("ab", "cd", top_logprobs=value).top[0]) == value
    else:
        with pytest.raises(InvalidRequestError, match="top_logprobs"):
            model.score("ab", "cd", top_logprobs=value)


def test_empty_and_too_long_continuations_are_refused() -> None:
    model = Model(FakeBackend(n_ctx=32), name="f", path=Path("f"), model_format="fake")
    with pytest.raises(InvalidRequestError):
        model.score("ab", "")
    with pytest.raises(InvalidRequestError, match="context"):
        model.score("ab", "x" * 40)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        model.score("ab", [10**9])


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    gguf = ggufgen.tiny_llama(seed=7).write(tmp_path_factory.mktemp("score") / "t.gguf")
    from edgeinfer.cli import main as cli_main

    onnx = gguf.parent / "native"
    assert cli_main(["convert", str(gguf), "-o", str(onnx), "--threads", "1"]) == 0
    return [gguf, onnx]


def test_real_engines_score_their_own_greedy_reply_as_its_top_tokens(engines: list[Path]) -> None:
    for path in engines:
        with edgeinfer.load(path, threads=1, context_length=256) as model:
            reply = model.generate("the cat sat on the", max_new_tokens=16, temperature=0)
            s = model.score("the cat sat on the", list(reply.token_ids), top_logprobs=2)
            for (first, second), token in zip(s.top, reply.token_ids, strict=True):
                # the greedy token is the top one, unless the two are within kernel noise
                assert first[0] == token or abs(first[1] - second[1]) < 1e-3
            again = model.generate("the cat sat on the", max_new_tokens=16, temperature=0)
            assert again.token_ids == reply.token_ids


def test_score_is_refused_at_parallel_above_one(engines: list[Path]) -> None:
    with edgeinfer.load(engines[0], threads=1, context_length=128, parallel=2) as model:
        with pytest.raises(InvalidRequestError, match="parallel=1"):
            model.score("ab", "cd")
