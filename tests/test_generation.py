"""The generator loop over the fake backend: finish reasons, stats, reuse, cancel, errors."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from edgeinfer import EdgeInferError, InvalidRequestError, ModelBusyError
from edgeinfer.generation.results import MIN_REREAD, REUSE_GRANULE
from edgeinfer.generation.turns import Turns
from edgeinfer.model import Model

from .fakes import EOS, FakeBackend


def make(**kwargs: object) -> tuple[Model, FakeBackend]:
    backend = FakeBackend(**kwargs)  # type: ignore[arg-type]
    return Model(backend, name="fake", path=Path("fake"), model_format="fake"), backend


def test_stream_joins_to_generate(fake_model: Model) -> None:
    for seed in (None, 7):
        kwargs = {"max_new_tokens": 40, "temperature": 0 if seed is None else 1.0, "seed": seed}
        result = fake_model.generate("hello", **kwargs)
        chunks = list(fake_model.stream("hello", **kwargs))
        assert "".join(c.text for c in chunks) == result.text
        assert tuple(t for c in chunks for t in c.token_ids) == result.token_ids
        assert chunks[-1].finish_reason == result.finish_reason == "length"
        assert all(c.finish_reason is None for c in chunks[:-1])


def test_stats_are_filled(fake_model: Model) -> None:
    stats = fake_model.generate("hello", max_new_tokens=10, temperature=0).stats
    assert stats.prompt_tokens == 5 and stats.completion_tokens == 10
    assert stats.ttft_s > 0 and stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert stats.total_s >= stats.ttft_s


def test_eos_ends_with_stop_and_is_not_in_the_output() -> None:
    model, _ = make(eos_boost=1000.0)
    result = model.generate("hi", max_new_tokens=10, temperature=0)
    assert result.finish_reason == "stop"
    assert result.token_ids == () and result.text == ""
    assert EOS not in result.token_ids


def test_stop_string_ends_generation_and_is_not_emitted(fake_model: Model) -> None:
    full = fake_model.generate("hello", max_new_tokens=60, temperature=0).text
    stop = full[10:13]
    result = fake_model.generate("hello", max_new_tokens=60, temperature=0, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]


def test_context_full_ends_with_length() -> None:
    model, backend = make(n_ctx=32)
    result = model.generate("x" * 20, max_new_tokens=100, temperature=0)
    assert result.finish_reason == "length"
    assert result.stats.prompt_tokens + result.stats.completion_tokens == 32
    assert backend.n_past <= 32


def test_prompt_longer_than_context_is_rejected() -> None:
    model, _ = make(n_ctx=32)
    with pytest.raises(InvalidRequestError, match="context"):
        model.generate("x" * 40)
    with pytest.raises(InvalidRequestError, match="context"):
        model.generate("x" * 32)  # no room left for a new token


def test_bad_requests_raise_typed_errors(fake_model: Model) -> None:
    with pytest.raises(InvalidRequestError):
        fake_model.generate("")
    with pytest.raises(InvalidRequestError):
        fake_model.generate([99999])
    with pytest.raises(InvalidRequestError):
        fake_model.generate(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="top_p"):
        fake_model.generate("hi", top_p=2)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        fake_model.generate("hi", logit_bias={10**6: 1.0})


def test_prompt_prefix_is_reused_and_output_matches_a_fresh_model() -> None:
    model, backend = make()
    start = "The quick brown animal jumps over the lazy dog: a "  # 50 bytes = 50 tokens
    first = model.generate(start + "fox", max_new_tokens=8, temperature=0)
    second = model.generate(start + "cat", max_new_tokens=8, temperature=0)
    assert first.stats.reused_prompt_tokens == 0
    # reuse ends at a multiple of REUSE_GRANULE (32) within the 50 common tokens
    assert second.stats.reused_prompt_tokens == REUSE_GRANULE
    assert backend.prefilled[-1] == len(start + "cat") - REUSE_GRANULE
    fresh, _ = make()
    expected = fresh.generate(start + "cat", max_new_tokens=8, temperature=0)
    assert second.token_ids == expected.token_ids


def test_same_prompt_twice_reads_at_least_its_last_eight_tokens_again() -> None:
    model, backend = make()
    prompt = "again " * 7 + "agai"  # 46 tokens: 38 could be reused, 32 are
    a = model.generate(prompt, max_new_tokens=5, temperature=0)
    b = model.generate(prompt, max_new_tokens=5, temperature=0)
    assert a.token_ids == b.token_ids
    assert b.stats.reused_prompt_tokens == 32 and backend.prefilled[-1] == 14
    prompt = "x" * 40  # 32 may be reused and 8 read again
    model.generate(prompt, max_new_tokens=2, temperature=0)
    c = model.generate(prompt, max_new_tokens=2, temperature=0)
    assert c.stats.reused_prompt_tokens == 32 and backend.prefilled[-1] == MIN_REREAD
    prompt = "y" * 39  # one short of that: read whole
    model.generate(prompt, max_new_tokens=2, temperature=0)
    d = model.generate(prompt, max_new_tokens=2, temperature=0)
    assert d.stats.reused_prompt_tokens == 0 and backend.prefilled[-1] == 39


def test_breaking_out_of_a_stream_leaves_the_model_usable() -> None:
    model, _ = make()
    for i, _chunk in enumerate(model.stream("hello", max_new_tokens=50, temperature=0)):
        if i == 3:
            break
    after = model.generate("world", max_new_tokens=20, temperature=0)
    fresh, _ = make()
    assert after.token_ids == fresh.generate("world", max_new_tokens=20, temperature=0).token_ids


def test_cancel_from_another_thread_ends_with_cancelled() -> None:
    model, _ = make()
    stream = model.stream("hello", max_new_tokens=200, temperature=0)
    first = next(stream)
    threading.Thread(target=stream.cancel).start()
    chunks = [first, *stream]
    assert chunks[-1].finish_reason == "cancelled"
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert stream.result.stats.completion_tokens < 200


def test_interrupt_in_the_consumer_leaves_the_model_usable() -> None:
    model, _ = make()
    with pytest.raises(KeyboardInterrupt):
        for i, _chunk in enumerate(model.stream("hello", max_new_tokens=50, temperature=0)):
            if i == 2:
                raise KeyboardInterrupt
    fresh, _ = make()
    expected = fresh.generate("hello", max_new_tokens=20, temperature=0).token_ids
    assert model.generate("hello", max_new_tokens=20, temperature=0).token_ids == expected


def test_chat_uses_the_template(fake_model: Model) -> None:
    text = fake_model.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<user>hi\n<assistant>"
    result = fake_model.chat([{"role": "user", "content": "hi"}], max_new_tokens=5, temperature=0)
    assert result.stats.prompt_tokens == len(text.encode())
    stream = fake_model.chat(
        [{"role": "user", "content": "hi"}], stream=True, max_new_tokens=5, temperature=0
    )
    assert "".join(c.text for c in stream) == result.text


def test_closed_model_refuses_requests() -> None:
    model, backend = make()
    model.close()
    model.close()  # idempotent
    assert backend.closed
    with pytest.raises(EdgeInferError, match="closed"):
        model.generate("hi")


def test_threads_sharing_a_model_are_served_one_at_a_time() -> None:
    model, _ = make()
    expected = {
        p: model.generate(p, max_new_tokens=15, temperature=0).token_ids
        for p in ("alpha", "beta", "gamma", "delta")
    }
    results: dict[str, tuple[int, ...]] = {}

    def worker(prompt: str) -> None:
        results[prompt] = model.generate(prompt, max_new_tokens=15, temperature=0).token_ids

    threads = [threading.Thread(target=worker, args=(p,)) for p in expected for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_stream_refuses_a_bad_request_before_iteration() -> None:
    model, _ = make(n_ctx=32)
    with pytest.raises(InvalidRequestError, match="context"):
        model.stream("x" * 40)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        model.stream("hi", logit_bias={10**6: 1.0})


def test_wait_false_raises_model_busy_while_another_request_runs() -> None:
    model, _ = make()
    running = model.stream("hello", max_new_tokens=50, temperature=0)
    next(running)  # holds the model now
    errors: list[BaseException] = []

    def other() -> None:
        try:
            model.generate("world", max_new_tokens=5, wait=False)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ModelBusyError)
    assert "another request" in str(errors[0])
    running.close()
    assert model.generate("world", max_new_tokens=5, wait=False).token_ids  # free again
    with pytest.raises(InvalidRequestError, match="wait"):
        model.generate("world", wait="no")  # type: ignore[arg-type]


def test_requests_are_served_in_arrival_order() -> None:
    model, _ = make()
    first = model.stream("hello", max_new_tokens=5, temperature=0)
    next(first)  # the model is busy until `first` ends
    order: list[int] = []

    def worker(i: int) -> None:
        model.generate(f"p{i}", max_new_tokens=2, temperature=0)
        order.append(i)

    threads = []
    for i in range(6):
        t = threading.Thread(target=worker, args=(i,))
        t.start()
        threads.append(t)
        while model._turns._issued < i + 2:  # wait until this thread has its ticket
            threading.Event().wait(0.001)
    first.close()
    for t in threads:
        t.join()
    assert order == list(range(6))


def test_a_waiter_that_gives_up_does_not_block_the_others() -> None:
    turns = Turns()
    holder = turns.turn()
    holder.__enter__()
    gave_up = threading.Event()

    def impatient() -> None:
        try:
            with turns.turn():
                pass
        except KeyboardInterrupt:
            gave_up.set()

    def interrupted_wait(timeout: float | None = None) -> bool:
        raise KeyboardInterrupt  # Ctrl-C while waiting for the turn

    turns._cond.wait = interrupted_wait  # type: ignore[method-assign]
    t = threading.Thread(target=impatient)
    t.start()
    t.join()
    del turns._cond.wait
    assert gave_up.is_set()
    holder.__exit__(None, None, None)
    with turns.turn(wait=False):  # the abandoned ticket was skipped
        assert turns.busy
    assert not turns.busy


def test_the_same_thread_asking_again_gets_an_error_not_a_hang() -> None:
    model, _ = make()
    held = model.stream("hello", max_new_tokens=50, temperature=0)
    next(held)  # this thread is inside an unfinished stream
    with pytest.raises(ModelBusyError, match="unfinished stream"):
        model.generate("world", max_new_tokens=3)
    held.close()
    assert model.generate("world", max_new_tokens=3).token_ids


def test_the_turn_ends_before_the_final_chunk() -> None:
    model, _ = make()
    stream = model.stream("hello", max_new_tokens=5, temperature=0)
    for chunk in stream:
        if chunk.finish_reason is not None:
            break  # stopped at the final chunk without exhausting the iterator
    assert not model._turns.busy
    assert model.generate("again", max_new_tokens=3).token_ids
