"""The llama.cpp backend's sequence slots: a sequence in any slot, stepped alone or with
others in one forward pass, reads what it reads alone in a one-slot backend, bit for bit.

Fast tests use a tiny random Llama written in the session and quantized to Q4_1 by llama.cpp,
as the default model is; one test (marked `model`) runs the default model. Every reference is
computed in the same run, on the CPU with flash attention off (the settings under which the
backend claims exactness, ``reuse_is_exact``): logits must be equal (``np.array_equal``), not
close. The f32 tiny model is not exact (its matrix kernel for several rows sums in another
order than for one: ~1e-4 apart after ten steps, measured); one test says what holds there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer import InvalidRequestError
from edgeinfer.config import LoadConfig
from edgeinfer.errors import BackendUnavailableError
from edgeinfer.files.gguf_file import read_gguf_header
from edgeinfer.machine.inventory import devices
from edgeinfer.machine.policy import plan_providers
from edgeinfer.runtimes.base import SlotBackend
from edgeinfer.runtimes.llama_cpp import LlamaCppBackend, open_backend

from .ggufgen import tiny_llama

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the gguf extra)")

# Token ids of the tiny model's byte-level vocabulary (267 tokens): prompts of 3 to 19 tokens.
PROMPTS = [
    [40, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88],
    [33, 34, 35],
    [90, 12, 200, 5, 64, 70, 17, 150, 99],
    [7, 8, 9, 10, 11, 260, 261],
    [101, 102, 103, 104, 105],
    [250, 3, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53],
]
N_NEW = 10
# Logits span about +-10; the f32 tiny model's batched rows drift from its rows alone by
# ~1.5e-4 after ten steps (measured on x86 AVX2): what its test allows.
F32_ATOL = 1e-3


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(context=256, seed=3).write(tmp_path_factory.mktemp("slots") / "t.gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_f32: Path) -> Path:
    """The tiny Llama quantized to Q4_1 (its output matrix Q8_0), as the default model is."""
    from edgeinfer.converters.gguf.writer import quantize_gguf

    out = tiny_f32.with_name("t-q4_1.gguf")
    quantize_gguf(tiny_f32, out, "q4_1", threads=1)
    return out


def open_slots(path: Path, parallel: int, **config: Any) -> LlamaCppBackend:
    cpu = plan_providers(devices(), "gguf", "cpu").candidates[0]
    settings = {"context_length": 64, "threads": 1, **config}
    load = LoadConfig(parallel=parallel, **settings)
    return open_backend(path, load, read_gguf_header(path), cpu)


@pytest.fixture
def slots4(tiny_gguf: Path) -> Iterator[LlamaCppBackend]:
    backend = open_slots(tiny_gguf, 4)
    yield backend
    backend.close()


def greedy_alone(
    path: Path, prompt: Sequence[int], n: int = N_NEW, **config: Any
) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the logits [n + 1, vocab] of ``prompt`` in a one-slot backend."""
    backend = open_slots(path, 1, **config)
    try:
        logits = [backend.prefill(prompt).copy()]
        tokens = []
        for _ in range(n):
            tokens.append(int(np.argmax(logits[-1])))
            logits.append(backend.decode(tokens[-1]).copy())
        return tokens, np.array(logits)
    finally:
        backend.close()


def assert_same_run(tokens: list[int], logits: list[np.ndarray], alone: tuple) -> None:
    """The alone run's greedy tokens, and its logits bit for bit at every position."""
    ref_tokens, ref_logits = alone
    assert tokens == ref_tokens[: len(tokens)]
    assert len(logits) == len(tokens) + 1 and len(ref_logits) >= len(logits)
    for i, row in enumerate(logits):
        if not np.array_equal(row, ref_logits[i]):
            worst = float(np.abs(row - ref_logits[i]).max())
            pytest.fail(f"logits at position {i} differ from alone by up to {worst:.3g}")


def test_the_backend_is_a_slot_backend(slots4: LlamaCppBackend, tiny_gguf: Path) -> None:
    assert isinstance(slots4, SlotBackend)
    assert slots4.n_slots == 4 and slots4.info["parallel"] == 4
    # the settings the exact comparisons below run under
    assert slots4.info["n_gpu_layers"] == 0 and slots4.info["flash_attention"] is False
    assert slots4.reuse_is_exact
    assert read_gguf_header(tiny_gguf).metadata["general.file_type"] == 3  # MOSTLY_Q4_1
    with closing(open_slots(tiny_gguf, 1)) as one:
        assert one.n_slots == 1 and one.info["parallel"] == 1
        assert slots4.kv_nbytes == 4 * one.kv_nbytes
        assert slots4.n_ctx == one.n_ctx == 64


@pytest.mark.parametrize("slot", [0, 2, 3])
def test_a_sequence_in_any_slot_reads_as_alone(
    slots4: LlamaCppBackend, tiny_gguf: Path, slot: int
) -> None:
    """Other slots hold other prompts; slot ``slot`` is prefilled and decoded one by one."""
    for other in range(4):
        if other != slot:
            slots4.prefill(PROMPTS[other + 1], other)
    logits = [slots4.prefill(PROMPTS[0], slot).copy()]
    tokens: list[int] = []
    for _ in range(N_NEW):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(slots4.decode(tokens[-1], slot).copy())
    assert slots4.slot_past(slot) == len(PROMPTS[0]) + N_NEW
    assert_same_run(tokens, logits, greedy_alone(tiny_gguf, PROMPTS[0]))


def _step_all(
    backend: LlamaCppBackend, runs: dict[int, tuple[list[int], list[np.ndarray]]], order: list[int]
) -> None:
    """One decode_many over the slots in ``order``: each appends its last greedy token."""
    rows = backend.decode_many([(s, runs[s][0][-1]) for s in order])
    assert rows.shape == (len(order), backend.tokenizer.n_vocab) and rows.dtype == np.float32
    for i, s in enumerate(order):
        runs[s][1].append(rows[i].copy())
        runs[s][0].append(int(np.argmax(rows[i])))


def _start(backend: LlamaCppBackend, prompts: dict[int, list[int]]) -> dict[int, Any]:
    runs = {}
    for slot, prompt in prompts.items():
        first = backend.prefill(prompt, slot).copy()
        runs[slot] = ([int(np.argmax(first))], [first])
    return runs


def _check_runs(path: Path, prompts: dict[int, list[int]], runs: dict[int, Any]) -> None:
    for slot, prompt in prompts.items():
        tokens, logits = runs[slot]
        assert_same_run(tokens[:-1], logits, greedy_alone(path, prompt, len(tokens)))


def test_decode_many_over_slots_of_different_lengths_matches_each_alone(
    slots4: LlamaCppBackend, tiny_gguf: Path
) -> None:
    prompts = {s: PROMPTS[s] for s in range(4)}  # 19, 3, 9 and 7 tokens
    runs = _start(slots4, prompts)
    for _ in range(N_NEW):
        _step_all(slots4, runs, [0, 1, 2, 3])
    _check_runs(tiny_gguf, prompts, runs)


def test_f32_weights_in_a_batch_stay_within_the_last_bits_of_alone(tiny_f32: Path) -> None:
    """What holds for f32 weights, which are not exact (see the module docstring): the same
    greedy tokens, and logits within F32_ATOL of alone."""
    prompts = {s: PROMPTS[s] for s in range(4)}
    with closing(open_slots(tiny_f32, 4)) as backend:
        runs = _start(backend, prompts)
        for _ in range(N_NEW):
            _step_all(backend, runs, [0, 1, 2, 3])
    for slot, prompt in prompts.items():
        tokens, logits = runs[slot]
        ref_tokens, ref_logits = greedy_alone(tiny_f32, prompt, len(tokens))
        assert tokens[:-1] == ref_tokens[: len(tokens) - 1]
        got = np.array(logits)
        np.testing.assert_allclose(got, ref_logits[: len(got)], rtol=0, atol=F32_ATOL)


def test_steps_with_gaps_and_in_any_order_match_each_alone(tiny_gguf: Path) -> None:
    """Random subsets of six slots, in random order: rows follow the order asked for, and a
    slot left out of a step keeps its cache."""
    rng = np.random.default_rng(7)
    with closing(open_slots(tiny_gguf, 6)) as backend:
        prompts = {s: PROMPTS[s] for s in range(6)}
        runs = _start(backend, prompts)
        for _ in range(3 * N_NEW):
            order = [int(s) for s in rng.permutation(6)[: rng.integers(1, 7)]]
            _step_all(backend, runs, order)
        _check_runs(tiny_gguf, prompts, runs)


def test_a_slot_not_in_a_step_keeps_its_cache(slots4: LlamaCppBackend) -> None:
    slots4.prefill(PROMPTS[2], 1)
    probe = slots4.decode(5, 1).copy()
    slots4.rewind(len(PROMPTS[2]), 1)
    runs = _start(slots4, {0: PROMPTS[0], 2: PROMPTS[3], 3: PROMPTS[4]})
    for _ in range(N_NEW):
        _step_all(slots4, runs, [0, 2, 3])  # slot 1 lies in the gap
        _step_all(slots4, runs, [3, 0])
    assert slots4.slot_past(1) == len(PROMPTS[2])
    np.testing.assert_array_equal(slots4.decode(5, 1), probe)


def test_rewind_of_one_slot_leaves_the_others(slots4: LlamaCppBackend, tiny_gguf: Path) -> None:
    prompts = {s: PROMPTS[s] for s in range(4)}
    runs = _start(slots4, prompts)
    for _ in range(3):
        _step_all(slots4, runs, [0, 1, 2, 3])
    slots4.rewind(2, 1)
    expected = [len(PROMPTS[s]) + 3 for s in range(4)]
    expected[1] = 2
    assert [slots4.slot_past(s) for s in range(4)] == expected
    assert slots4.n_past == slots4.slot_past(0)
    first = slots4.prefill(PROMPTS[5], 1).copy()  # slot 1 goes on from its first 2 tokens
    runs[1] = ([int(np.argmax(first))], [first])
    prompts[1] = PROMPTS[1][:2] + PROMPTS[5]
    for _ in range(N_NEW - 3):
        _step_all(slots4, runs, [0, 1, 2, 3])
    _check_runs(tiny_gguf, prompts, runs)


def test_slot_numbers_and_steps_are_checked(slots4: LlamaCppBackend) -> None:
    for bad in (4, -1, True, 1.0, "0", None):
        with pytest.raises(InvalidRequestError, match="slot"):
            slots4.prefill([1, 2], bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="slot"):
            slots4.decode(1, bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="slot"):
            slots4.rewind(0, bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="slot"):
            slots4.slot_past(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="slot"):
            slots4.decode_many([(bad, 1)])  # type: ignore[list-item]
    for bad_steps in ([], [(0, 1), (0, 2)], [(0,)], [(0, "x")], [3], None):
        with pytest.raises(InvalidRequestError):
            slots4.decode_many(bad_steps)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="rewind"):
        slots4.rewind(1, 2)  # slot 2 is empty
    slots4.prefill(list(range(1, 65)), 2)  # slot 2 is full
    with pytest.raises(InvalidRequestError, match="full"):
        slots4.decode_many([(0, 1), (2, 1)])
    assert [slots4.slot_past(s) for s in range(4)] == [0, 0, 64, 0]


def test_a_full_slot_between_two_in_a_step_is_left_as_it_is(tiny_gguf: Path) -> None:
    """llama.cpp gives each sequence a multiple of 256 cells: at 256 a full slot has no room
    for anything, and a step over its neighbours must not need any."""
    with closing(open_slots(tiny_gguf, 3, context_length=256)) as backend:
        backend.prefill([7] * 256, 1)
        backend.prefill([8, 9], 0)
        backend.decode_many([(2, 1), (0, 1)])
        assert [backend.slot_past(s) for s in range(3)] == [3, 256, 1]


def test_more_slots_than_the_prefill_batch(tiny_gguf: Path) -> None:
    """A planned batch of 4 tokens and 6 slots: the step still carries all six, and prompts
    are still read in chunks of 4 as in a one-slot backend with that batch."""
    with closing(open_slots(tiny_gguf, 6, batch_size=4)) as backend:
        assert backend.info["batch_size"] == 4
        prompts = {s: PROMPTS[s] for s in range(6)}
        runs = _start(backend, prompts)
        for _ in range(N_NEW):
            _step_all(backend, runs, list(range(6)))
        for slot, prompt in prompts.items():
            tokens, logits = runs[slot]
            alone = greedy_alone(tiny_gguf, prompt, len(tokens), batch_size=4)
            assert_same_run(tokens[:-1], logits, alone)


class _FailingDecode:
    """The engine module, but llama_decode reports failure after doing its work: a batch that
    failed part way, its entries written for some slots."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        self._real.llama_decode(ctx, batch)
        return 2


def test_a_failed_step_leaves_every_slot_as_it_was(
    slots4: LlamaCppBackend, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = {s: PROMPTS[s] for s in range(4)}
    runs = _start(slots4, prompts)
    _step_all(slots4, runs, [0, 1, 2, 3])
    before = [slots4.slot_past(s) for s in range(4)]
    real = slots4._llama
    monkeypatch.setattr(slots4, "_llama", _FailingDecode(real))
    with pytest.raises(BackendUnavailableError, match="decode"):
        slots4.decode_many([(0, 9), (3, 9), (1, 9)])  # two runs: 0-1 and 3
    with pytest.raises(BackendUnavailableError, match="decode"):
        slots4.prefill([1, 2, 3], 2)
    monkeypatch.setattr(slots4, "_llama", real)
    assert [slots4.slot_past(s) for s in range(4)] == before
    with pytest.raises(BackendUnavailableError):  # an id outside the vocabulary
        slots4.decode_many([(0, 10**6), (1, runs[1][0][-1])])
    assert [slots4.slot_past(s) for s in range(4)] == before
    for _ in range(N_NEW):
        _step_all(slots4, runs, [0, 1, 2, 3])
    _check_runs(tiny_gguf, prompts, runs)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.one_of(st.integers(-2, 6), st.none(), st.booleans()), st.integers(-5, 300)),
        max_size=6,
    )
)
def test_any_step_list_is_run_or_refused(slots4: LlamaCppBackend, steps: list) -> None:
    """Whatever the pairs, a step either runs (one row each) or raises one of our errors,
    and the slots' counts move by exactly one for each slot that ran."""
    before = [slots4.slot_past(s) for s in range(4)]
    if max(before) >= 60:
        for s in range(4):
            slots4.rewind(0, s)
        before = [0] * 4
    try:
        rows = slots4.decode_many(steps)
    except (InvalidRequestError, BackendUnavailableError):
        assert [slots4.slot_past(s) for s in range(4)] == before
        return
    assert rows.shape == (len(steps), slots4.tokenizer.n_vocab)
    ran = {s for s, _ in steps}
    assert [slots4.slot_past(s) for s in range(4)] == [b + (s in ran) for s, b in enumerate(before)]


@pytest.mark.model
def test_default_model_in_four_slots_matches_alone(default_gguf: Path) -> None:
    texts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):",
        "Water boils at",
    ]
    config = {"context_length": 256, "threads": 1}
    with closing(open_slots(default_gguf, 4, **config)) as backend:
        prompts = {s: backend.tokenizer.encode(t) for s, t in enumerate(texts)}
        runs = _start(backend, prompts)
        for i in range(16):
            _step_all(backend, runs, [0, 1, 2, 3] if i % 3 else [3, 1])
        for slot, prompt in prompts.items():
            tokens, logits = runs[slot]
            alone = greedy_alone(default_gguf, prompt, len(tokens), **config)
            assert_same_run(tokens[:-1], logits, alone)
