"""The engine loop (parallel > 1): many callers share one batch, each sequence keeps its own
settings, and each gives exactly what it gives alone (the fake's logits depend on its own
slot's history only, so any mix-up of slots shows as different output). The fake's logits
cannot depend on batch make-up or chunk alignment: tests/test_engine_real.py checks the
same promises on real models (llama.cpp and onnxruntime)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from edgeinfer import EdgeInferError, InvalidRequestError, ModelBusyError
from edgeinfer.model import Model

from .fakes import EOS, FakeBackend, FakeSlotBackend

PROMPTS = [f"prompt number {i}: " + "x" * (3 * i) for i in range(8)]


def slotted(n_slots: int = 4, **kwargs: object) -> tuple[Model, FakeSlotBackend]:
    backend = FakeSlotBackend(n_slots=n_slots, **kwargs)  # type: ignore[arg-type]
    return Model(backend, name="fake", path=Path("fake"), model_format="fake"), backend


def alone(prompt: str, n_ctx: int = 256, **sampling: object) -> tuple[str, str]:
    model = Model(FakeBackend(n_ctx=n_ctx), name="fake", path=Path("fake"), model_format="fake")
    result = model.generate(prompt, **sampling)
    return result.text, result.finish_reason


def run_threads(model: Model, prompts: list[str], **sampling: object) -> list[tuple[str, str]]:
    results: list[tuple[str, str] | None] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        start.wait()
        result = model.generate(prompts[i], **sampling)
        results[i] = (result.text, result.finish_reason)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def decode_batches(backend: FakeSlotBackend) -> list[tuple[int, ...]]:
    return [step[1] for step in backend.steps if step[0] == "decode"]


def test_threads_share_one_batch_and_each_equals_its_output_alone() -> None:
    model, backend = slotted(4)
    got = run_threads(model, PROMPTS[:6], max_new_tokens=24, temperature=0)
    assert got == [alone(p, max_new_tokens=24, temperature=0) for p in PROMPTS[:6]]
    assert max(len(b) for b in decode_batches(backend)) > 1  # steps carried several sequences
    assert model.activity == {"slots": 4, "busy": 0, "queued": 0}
    assert model.parallel == 4 and model.info["parallel"] == 4


def test_seeded_sampling_per_sequence_equals_alone() -> None:
    model, _ = slotted(3)
    sampling = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    got = run_threads(model, PROMPTS[:5], **sampling)
    assert got == [alone(p, **sampling) for p in PROMPTS[:5]]


def test_generate_many_keeps_input_order_and_each_request_its_settings() -> None:
    model, backend = slotted(2)
    requests = [
        PROMPTS[0],
        {"prompt": PROMPTS[1], "max_new_tokens": 5},
        {"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 7},
        {"prompt": PROMPTS[3], "stop": ["a"]},
    ]
    results = model.generate_many(requests, max_new_tokens=12, temperature=0)
    assert [r.text for r in results][:2] == [
        alone(PROMPTS[0], max_new_tokens=12, temperature=0)[0],
        alone(PROMPTS[1], max_new_tokens=5, temperature=0)[0],
    ]
    assert results[1].stats.completion_tokens <= 5
    assert results[2].stats.completion_tokens <= 7
    assert "a" not in results[3].text
    assert max(len(b) for b in decode_batches(backend)) == 2


def test_generate_many_checks_every_request_before_any_runs() -> None:
    model, backend = slotted(2)
    with pytest.raises(InvalidRequestError, match=r"requests\[2\]"):
        model.generate_many([PROMPTS[0], PROMPTS[1], {"prompt": "x", "nonsense": 1}])
    with pytest.raises(InvalidRequestError, match=r"requests\[1\]"):
        model.generate_many(["ok", {"prompt": "x", "messages": []}])
    with pytest.raises(InvalidRequestError, match="list of requests"):
        model.generate_many("a prompt")  # type: ignore[arg-type]
    assert backend.steps == []


def test_cancelling_one_sequence_leaves_the_others_running() -> None:
    model, backend = slotted(3)
    backend.delay = 0.002
    streams = [model.stream(p, max_new_tokens=40, temperature=0) for p in PROMPTS[:3]]
    firsts = [next(s) for s in streams]  # all three joined the batch
    assert all(f.finish_reason is None for f in firsts)
    streams[1].cancel()
    results = [s.collect() for s in streams]
    assert results[1].finish_reason == "cancelled"
    for i in (0, 2):
        assert (results[i].text, results[i].finish_reason) == alone(
            PROMPTS[i], max_new_tokens=40, temperature=0
        )


def test_leaving_a_stream_frees_its_slot() -> None:
    model, _ = slotted(2)
    stream = model.stream(PROMPTS[0], max_new_tokens=200, temperature=0)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 10
    while model.activity["busy"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model.activity["busy"] == 0
    assert (
        model.generate(PROMPTS[1], max_new_tokens=8, temperature=0).text
        == alone(PROMPTS[1], max_new_tokens=8, temperature=0)[0]
    )


def test_wait_false_raises_when_every_slot_is_busy() -> None:
    model, backend = slotted(2)
    backend.delay = 0.01
    held = [model.stream(p, max_new_tokens=500, temperature=0) for p in PROMPTS[:2]]
    for s in held:
        next(s)
    with pytest.raises(ModelBusyError, match="slots"):
        next(model.stream(PROMPTS[2], wait=False))
    for s in held:
        s.close()


def test_a_long_prompt_is_read_in_chunks_while_the_others_keep_decoding() -> None:
    model, backend = slotted(2, n_ctx=1024)
    backend.delay = 0.002
    running = model.stream(PROMPTS[0], max_new_tokens=300, temperature=0)
    next(running)
    long_prompt = "y" * 400
    result = model.generate(long_prompt, max_new_tokens=4, temperature=0)
    running.close()
    assert result.text == alone(long_prompt, 1024, max_new_tokens=4, temperature=0)[0]
    chunks = [s[2] for s in backend.steps if s[0] == "prefill" and s[1] != 0]
    assert len(chunks) > 1 and max(chunks) <= 64  # read in bounded chunks
    # between its chunks the running stream decoded
    kinds = [s[0] for s in backend.steps]
    first = kinds.index("prefill", 1)
    assert "decode" in kinds[first : first + 2 * len(chunks)]


def test_a_repeated_prompt_reuses_its_slots_cache_exactly() -> None:
    model, _ = slotted(2)
    prompt = "z" * 100
    first = model.generate(prompt, max_new_tokens=6, temperature=0)
    second = model.generate(prompt, max_new_tokens=6, temperature=0)
    assert second.stats.reused_prompt_tokens > 0
    assert second.text == first.text == alone(prompt, max_new_tokens=6, temperature=0)[0]


def test_a_failed_forward_pass_ends_the_running_sequences_and_the_model_goes_on() -> None:
    model, backend = slotted(2)
    backend.delay = 0.005
    streams = [model.stream(p, max_new_tokens=50, temperature=0) for p in PROMPTS[:2]]
    for s in streams:
        next(s)
    backend.fail_next_decode = True
    for s in streams:
        with pytest.raises(RuntimeError, match="engine failed"):
            s.collect()
    assert (
        model.generate(PROMPTS[2], max_new_tokens=6, temperature=0).text
        == alone(PROMPTS[2], max_new_tokens=6, temperature=0)[0]
    )


def test_a_full_context_ends_each_sequence_with_length_or_slides() -> None:
    model, _ = slotted(2, n_ctx=64)
    no_eos = {"logit_bias": {EOS: float("-inf")}, "temperature": 0}
    results = model.generate_many(PROMPTS[:2], max_new_tokens=500, **no_eos)
    assert [r.finish_reason for r in results] == ["length", "length"]
    sliding = Model(
        FakeSlotBackend(n_slots=2, n_ctx=64),
        name="fake",
        path=Path("fake"),
        model_format="fake",
        context_overflow="slide",
    )
    long = sliding.generate_many(PROMPTS[:2], max_new_tokens=150, **no_eos)
    assert [r.stats.completion_tokens for r in long] == [150, 150]


def test_close_ends_running_streams_and_refuses_new_requests() -> None:
    model, backend = slotted(2)
    backend.delay = 0.005
    stream = model.stream(PROMPTS[0], max_new_tokens=500, temperature=0)
    next(stream)
    model.close()
    assert stream.collect().finish_reason == "cancelled"
    assert backend.closed
    with pytest.raises(EdgeInferError, match="closed"):
        model.generate(PROMPTS[1])


def test_new_sequences_take_the_lowest_free_slot_unless_another_holds_their_prefix() -> None:
    model, backend = slotted(4)
    backend.delay = 0.002
    long_a, long_b = "a" * 80, "b" * 80
    model.generate_many([long_a, long_b], max_new_tokens=4, temperature=0)  # slots 0 and 1
    backend.steps.clear()
    result = model.generate(long_b + " again", max_new_tokens=4, temperature=0)
    assert result.stats.reused_prompt_tokens >= 64  # went back to slot 1, which holds long_b
    assert {s[1] for s in backend.steps if s[0] == "prefill"} == {1}
    backend.steps.clear()
    model.generate("c" * 80, max_new_tokens=4, temperature=0)  # no prefix anywhere: slot 0
    assert {s[1] for s in backend.steps if s[0] == "prefill"} == {0}


def test_a_burst_of_requests_is_read_whole_before_it_decodes_together() -> None:
    model, backend = slotted(4)
    gate = threading.Event()
    backend.prefill_gate = gate  # the first prefill waits until the whole burst is queued
    results: list[object] = []
    burst = threading.Thread(
        target=lambda: results.extend(model.generate_many(PROMPTS[:4], max_new_tokens=8)),
    )
    burst.start()
    deadline = time.monotonic() + 30
    while sum(model.activity[k] for k in ("busy", "queued")) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    burst.join(30)
    assert len(results) == 4
    kinds = [step[0] for step in backend.steps]
    assert kinds[:4] == ["prefill"] * 4  # all four prompts read in the first step
    assert decode_batches(backend)[0] == (0, 1, 2, 3)  # then they decode together


def test_a_model_dropped_without_close_stops_its_engine_thread() -> None:
    """The loop thread holds the backend; a model that is only dropped must not keep both
    alive until the process ends. A stream still being read keeps its model."""
    import gc
    import weakref

    def engine_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "edgeinfer-engine"]

    gc.collect()
    before = len(engine_threads())
    model, backend = slotted(2)
    backend_ref = weakref.ref(backend)
    stream = model.stream(PROMPTS[0], max_new_tokens=4, temperature=0)
    del model, backend
    gc.collect()
    assert stream.collect().finish_reason in ("stop", "length")  # read to its end
    del stream
    gc.collect()
    deadline = time.monotonic() + 30
    while len(engine_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine_threads()) == before
    gc.collect()
    assert backend_ref() is None  # nothing holds the backend any more
