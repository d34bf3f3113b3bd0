"""One generation loop for every parallelism, with speculative decoding inside it.

The engine's loop (``edgeinfer.generation.scheduler``) serves ``parallel=1`` (one slot,
stepped in the caller's thread) and ``parallel>1`` (its own thread). A slot that runs alone
drafts and verifies in one pass; while other slots run it steps aside into the batched step.
Either way
a request's tokens are the ones plain decoding gives alone, and no rejected draft is left in
any slot's cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from edgeinfer.generation import scheduler as engine_module
from edgeinfer.generation.delivery import Submitted
from edgeinfer.model import Model

from .test_speculative import PROMPTS, CopyingBackend


class CopyingSlots(CopyingBackend):
    """CopyingBackend with ``n_slots`` sequences (each slot's logits depend on its own
    history only). ``forwards`` records, for each multi-position pass, what ``on_forward``
    returned (the test's view of the engine at that moment)."""

    def __init__(self, n_slots: int = 4, n_ctx: int = 512) -> None:
        super().__init__(n_ctx=n_ctx)
        self._caches: list[list[int]] = [[] for _ in range(n_slots)]
        self.on_forward: Callable[[], object] = lambda: None
        self.forwards: list[object] = []
        self.batched_steps = 0  # decode_many calls carrying more than one slot

    n_slots = property(lambda self: len(self._caches))

    def slot_past(self, slot: int) -> int:
        return len(self._caches[slot])

    def _with(self, slot: int) -> None:
        self.cache = self._caches[slot]

    def prefill(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        self._with(slot)
        return super().prefill(token_ids)

    def decode(self, token_id: int, slot: int = 0) -> np.ndarray:
        self._with(slot)
        return CopyingBackend.prefill(self, [token_id])

    def forward(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        self.forwards.append(self.on_forward())
        self._with(slot)
        return super().forward(token_ids)

    def rewind(self, n: int, slot: int = 0) -> None:
        self._with(slot)
        super().rewind(n)

    def decode_many(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        self.batched_steps += len(steps) > 1
        return np.stack([self.decode(token, slot) for slot, token in steps])


def slotted(n_slots: int = 4) -> tuple[Model, CopyingSlots]:
    backend = CopyingSlots(n_slots)
    return Model(backend, name="c", path=Path("c"), model_format="fake"), backend


def one_slot() -> Model:
    return Model(CopyingBackend(), name="c", path=Path("c"), model_format="fake")


GREEDY = {"max_new_tokens": 48, "temperature": 0}


@pytest.mark.parametrize("spec", ["lookup", "lookup:3", "auto"])
def test_a_request_alone_in_the_engine_drafts_and_gives_plain_tokens(spec: str) -> None:
    model, backend = slotted(4)
    reference = one_slot()
    try:
        drafted = accepted = 0
        for prompt in PROMPTS:
            plain = reference.generate(prompt, **GREEDY)
            fast = model.generate(prompt, speculative=spec, **GREEDY)
            assert fast.token_ids == plain.token_ids, prompt
            assert fast.finish_reason == plain.finish_reason
            drafted += fast.stats.draft_tokens
            accepted += fast.stats.accepted_tokens
        assert accepted > 0 and drafted > accepted  # drafts were kept, and some were not
        assert backend.forwards  # the verify passes ran inside the engine
    finally:
        model.close()


def test_sampled_tokens_in_the_engine_equal_plain_under_a_seed() -> None:
    model, _ = slotted(2)
    reference = one_slot()
    try:
        for seed in range(6):
            for prompt in PROMPTS[:4]:
                kw = {"max_new_tokens": 32, "temperature": 0.8, "top_k": 0, "seed": seed}
                plain = reference.generate(prompt, **kw)
                fast = model.generate(prompt, speculative="lookup", **kw)
                assert fast.token_ids == plain.token_ids, (seed, prompt)
    finally:
        model.close()


def test_concurrent_requests_step_aside_and_each_equals_plain_alone() -> None:
    model, backend = slotted(4)
    backend.on_forward = lambda: model.activity  # who else ran at each verify pass
    reference = one_slot()
    expected = [reference.generate(p, **GREEDY).token_ids for p in PROMPTS]
    got: list[list[int] | None] = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def worker(i: int) -> None:
        start.wait()
        got[i] = model.generate(PROMPTS[i], speculative="lookup", **GREEDY).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == expected
        assert backend.batched_steps > 0  # the streams shared steps
        # a verify pass ran only while its slot was the one sequence running or waiting
        assert all(a["busy"] == 1 for a in backend.forwards)  # type: ignore[index]
        for slot in range(4):  # no rejected draft is left in any slot's cache
            history = model._engine._slots[slot].history  # type: ignore[attr-defined]
            assert backend.slot_past(slot) == len(history.tokens)
    finally:
        model.close()


def test_parallel_one_runs_the_engine_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """There is one loop: a one-slot model's requests are the engine's steps, taken in the
    caller's thread (no engine thread is started)."""
    steps: list[str] = []
    original = engine_module.Engine._step

    def counted(self: engine_module.Engine) -> None:
        steps.append(threading.current_thread().name)
        original(self)

    monkeypatch.setattr(engine_module.Engine, "_step", counted)
    model = one_slot()
    before = threading.active_count()
    result = model.generate(PROMPTS[0], speculative="lookup", **GREEDY)
    assert threading.active_count() == before
    assert steps and set(steps) == {threading.current_thread().name}
    assert result.stats.draft_tokens > 0
    assert model._backend.n_past == len(model._history.tokens)


def test_one_slot_and_many_slots_give_the_same_stream() -> None:
    model, _ = slotted(3)
    reference = one_slot()
    try:
        for prompt in PROMPTS[:4]:
            a = [c.text for c in reference.stream(prompt, **GREEDY)]
            b = [c.text for c in model.stream(prompt, **GREEDY)]
            assert "".join(a) == "".join(b)
    finally:
        model.close()


class _Disk:
    """A prompt cache that records when the loop asks it to copy a prompt."""

    def __init__(self) -> None:
        self.remembered: list[tuple[int, int]] = []

    def restore(self, backend: object, history: object, prompt: list[int], slot: int = 0) -> int:
        return 0

    def remember(self, prompt: list[int], prefilled: int, slot: int = 0) -> None:
        self.remembered.append((len(prompt), prefilled))


def test_the_prompt_cache_copies_after_the_first_chunk_is_out() -> None:
    disk = _Disk()
    backend = CopyingBackend()
    loop = engine_module.Engine(backend, threaded=False, disk=disk)
    model = one_slot()
    ids = model.tokenize(PROMPTS[0])
    chunks = loop.run(Submitted(ids, _sampler(model, ids, 8), threading.Event(), None))  # type: ignore[arg-type]
    first = next(chunks)
    assert first.text and disk.remembered == []  # the reply starts before the copy
    rest = list(chunks)
    assert rest[-1].finish_reason == "length"
    assert disk.remembered == [(len(ids), len(ids))]


def test_a_cancel_after_a_verify_pass_ends_the_stream_cancelled_with_every_token() -> None:
    model = one_slot()
    prompt = PROMPTS[3] * 4  # copies well: a pass keeps several drafts
    stream = model.stream(prompt, max_new_tokens=64, temperature=0, speculative="lookup:8")
    first = next(stream)
    stream.cancel()
    result = stream.collect()
    assert result.finish_reason == "cancelled"
    assert result.token_ids[: len(first.token_ids)] == first.token_ids
    assert model.detokenize(list(result.token_ids)) == result.text
    assert result.stats.completion_tokens == len(result.token_ids)
    assert model._backend.n_past <= len(model._history.tokens) + 1


class _FailingOnce(CopyingBackend):
    def __init__(self) -> None:
        super().__init__()
        self.fail_at: int | None = None

    def decode(self, token_id: int) -> np.ndarray:
        if self.fail_at is not None and len(self.cache) >= self.fail_at:
            self.fail_at = None
            self.cache.append(token_id)  # the engine wrote the entry, then failed
            raise KeyboardInterrupt
        return super().decode(token_id)


def test_an_interrupted_step_keeps_the_reusable_prefix() -> None:
    backend = _FailingOnce()
    model = Model(backend, name="c", path=Path("c"), model_format="fake")
    prompt = " ".join(["a long shared prompt"] * 20)
    n = len(model.tokenize(prompt))
    backend.fail_at = n + 5
    with pytest.raises(KeyboardInterrupt):
        model.generate(prompt, max_new_tokens=32, temperature=0)
    assert backend.n_past == len(model._history.tokens) >= n  # nothing past the history
    again = model.generate(prompt, max_new_tokens=8, temperature=0)
    assert again.stats.reused_prompt_tokens > 0  # the prompt was not read again whole
    fresh = one_slot().generate(prompt, max_new_tokens=8, temperature=0)
    assert again.token_ids == fresh.token_ids


def _greedy(n: int) -> object:
    from edgeinfer.generation.sampling import SamplingConfig

    return SamplingConfig(temperature=0, max_new_tokens=n)


def _sampler(model: Model, ids: list[int], n: int) -> object:
    from edgeinfer.generation.results import check_request

    return check_request(model._backend, ids, _greedy(n))  # type: ignore[arg-type]


def test_a_request_cancelled_before_it_begins_ends_cancelled_without_touching_the_engine() -> None:
    """A stream begun while the model is being closed (its cancel already set) ends
    "cancelled" at once; the engine is not touched, so a closing backend is safe."""
    backend = CopyingBackend()
    loop = engine_module.Engine(backend, threaded=False)
    model = one_slot()
    ids = model.tokenize(PROMPTS[0])
    cancel = threading.Event()
    cancel.set()
    loop.close()  # closing: a request that had passed its check still begins
    chunks = list(loop.run(Submitted(ids, _sampler(model, ids, 8), cancel, None)))  # type: ignore[arg-type]
    assert [c.finish_reason for c in chunks] == ["cancelled"]
    assert chunks[0].stats is not None and chunks[0].stats.prefill_tokens_per_s == 0
    assert backend.passes == 0
