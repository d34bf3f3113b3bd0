"""The engine loop's promises on real models: the tiny random Llama quantized to Q4_1 (as the
default model is) on llama.cpp, and the same file's native ONNX transcode (MatMulNBits) on
onnxruntime. Slot admission, batch composition, prefix reuse, prompts read in chunks and
cancellation, each compared with the same requests run alone (a ``parallel=1`` model of the
same file, in the same run): greedy token ids must be equal.

Both routes are batch-invariant on the tiny model: llama.cpp by construction (one KV stream
per slot, per-row Q4_1/Q8_0 kernels), and the tiny ONNX graph measured so (a row of
``decode_many`` equals ``decode`` bit for bit, 1 and 2 threads, x86 AVX2). On the default
model's ONNX route a one-row step may take another MatMulNBits kernel on some CPUs, and the
backend then pairs lone steps with a spare row (tests/test_lone_rows.py; the default model
alone and in batches: tests/test_batch_invariance.py); rows of batches of two or more agree
among themselves whatever the CPU, the last test here (marked ``model``).

The engine runs the real backend; a spy on the backend instance records each forward pass
(and can hold the engine thread at one, so a state is reached without timing).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import edgeinfer
from edgeinfer.generation.results import REUSE_GRANULE, GenerationResult
from edgeinfer.model import Model

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the gguf extra)")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

CTX = 256
N = 16  # greedy tokens per reply
WORDS = "the quick brown fox jumps over a lazy dog while seven tall wizards quietly hum " * 2
LONG = " ".join(f"item {i}," for i in range(40))[:200]  # shares no prefix with the others
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def main():",
    "Lorem ipsum dolor sit amet, consectetur",
    "Hello hello hello, and hello",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def tiny_q4_1(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edgeinfer.converters.gguf.writer import quantize_gguf

    out = tmp_path_factory.mktemp("engine-q4_1") / "tiny-q4_1.gguf"
    quantize_gguf(tiny_llama_gguf, out, "q4_1", threads=1)
    return out


@pytest.fixture(scope="module")
def tiny_onnx(tiny_q4_1: Path, native_folder: Callable[[Path, int], Path]) -> Path:
    return native_folder(tiny_q4_1, CTX)


@dataclass
class Pair:
    """The model under test (3 slots) and the reference (1 slot), on the same file."""

    many: Model
    one: Model
    greedy: dict[str, Any]  # temperature 0, end-of-generation tokens banned, N tokens

    def alone(self, prompt: str, **sampling: Any) -> list[int]:
        """``prompt``'s greedy ids from the one-slot model, its prompt read whole."""
        self.one.generate("\n", max_new_tokens=1, temperature=0)  # no prefix left to reuse
        result = self.one.generate(prompt, **{**self.greedy, **sampling})
        assert result.stats.reused_prompt_tokens == 0
        return list(result.token_ids)


@pytest.fixture(scope="module", params=["llama.cpp", "onnxruntime"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    path = request.getfixturevalue("tiny_q4_1" if request.param == "llama.cpp" else "tiny_onnx")
    one = edgeinfer.load(path, parallel=1, threads=1, context_length=CTX)
    many = edgeinfer.load(path, parallel=3, threads=1, context_length=CTX)
    try:
        assert many.info["backend"] == one.info["backend"] == request.param
        assert many.parallel == 3 and many._backend.reuse_is_exact
        greedy = {"temperature": 0, "max_new_tokens": N, "logit_bias": no_end(many)}
        yield Pair(many, one, greedy)
    finally:
        many.close()
        one.close()


def no_end(model: Model) -> dict[int, float]:
    """A logit bias that bans every end-of-generation token: replies run to their length."""
    tokenizer = model._backend.tokenizer
    ends = [t for t in range(tokenizer.n_vocab) if tokenizer.is_end_of_generation(t)]
    assert ends
    return {t: -100.0 for t in ends}


@dataclass
class Spy:
    """Each forward pass the engine runs: ("prefill", slot, tokens, cache length before, the
    ids) or ("decode", slots). A gate that is clear holds the engine thread at that kind of pass."""

    log: list[tuple[Any, ...]] = field(default_factory=list)
    gates: dict[str, threading.Event] = field(default_factory=dict)

    def hold(self, kind: str) -> threading.Event:
        self.gates[kind] = threading.Event()
        return self.gates[kind]

    def _pass(self, entry: tuple[Any, ...]) -> None:
        self.log.append(entry)
        gate = self.gates.get(entry[0])
        if gate is not None:
            gate.wait(120)

    def kinds(self) -> list[str]:
        return [entry[0] for entry in self.log]

    def prefills(self, slot: int | None = None) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[0] == "prefill" and slot in (None, e[1])]

    def decodes(self) -> list[tuple[int, ...]]:
        return [e[1] for e in self.log if e[0] == "decode"]


@contextmanager
def spied(model: Model) -> Iterator[Spy]:
    backend, spy = model._backend, Spy()
    prefill, decode, decode_many = backend.prefill, backend.decode, backend.decode_many

    def spy_prefill(ids: Any, slot: int = 0) -> Any:
        spy._pass(("prefill", slot, len(ids), backend.slot_past(slot), tuple(ids)))
        return prefill(ids, slot)

    def spy_decode(token: int, slot: int = 0) -> Any:
        spy._pass(("decode", (slot,)))
        return decode(token, slot)

    def spy_decode_many(steps: Any) -> Any:
        spy._pass(("decode", tuple(s for s, _ in steps)))
        return decode_many(steps)

    backend.prefill, backend.decode, backend.decode_many = spy_prefill, spy_decode, spy_decode_many
    try:
        yield spy
    finally:
        for gate in spy.gates.values():
            gate.set()
        del backend.prefill, backend.decode, backend.decode_many


def wait_for(condition: Callable[[], Any], what: str) -> None:
    """Poll until ``condition`` holds (a state to reach, not a time to meet)."""
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    return thread, out


def ids(results: list[GenerationResult]) -> list[list[int]]:
    return [list(r.token_ids) for r in results]


def idle(model: Model) -> bool:
    return model.activity == {"slots": 3, "busy": 0, "queued": 0}


# -- admission and batch composition -------------------------------------------------------


def together(
    model: Model, requests: list[Any], **sampling: Any
) -> tuple[list[GenerationResult], Spy]:
    """``generate_many(requests)`` with the first prompt held until every request is in, so
    they are admitted as one burst (as many as there are slots) and decode together."""
    with spied(model) as spy:
        gate = spy.hold("prefill")
        thread, out = in_thread(lambda: model.generate_many(requests, **sampling))
        n = len(requests)
        wait_for(lambda: sum(model.activity[k] for k in ("busy", "queued")) == n, "all in")
        assert model.activity["busy"] <= model.parallel
        gate.set()
        thread.join(300)
    assert not thread.is_alive() and len(out) == 1
    return out[0], spy


def test_a_burst_over_the_slots_waits_its_turn_and_each_equals_alone(pair: Pair) -> None:
    """Six requests on three slots: three run, three wait in order; the forward passes carry
    at most three rows; every reply is what the request gives alone."""
    results, spy = together(pair.many, PROMPTS, **pair.greedy)
    assert ids(results) == [pair.alone(p) for p in PROMPTS]
    encode = pair.many._backend.tokenizer.encode
    read = [(e[1], e[4]) for e in spy.prefills()]  # (slot, ids): each prompt read whole
    assert [i for _, i in read] == [tuple(encode(p)) for p in PROMPTS]  # first come first in
    assert [slot for slot, _ in read[:3]] == [0, 1, 2]
    assert all(r.finish_reason == "length" and r.stats.completion_tokens == N for r in results)
    assert max(len(rows) for rows in spy.decodes()) == 3
    assert {slot for rows in spy.decodes() for slot in rows} == {0, 1, 2}
    wait_for(lambda: idle(pair.many), "every slot free")


def test_a_sequence_gives_the_same_tokens_whatever_its_companions(pair: Pair) -> None:
    """The same request first, second and third of a batch, beside others that end before it
    (the batch shrinks under it) or after it: always its tokens alone."""
    probe = PROMPTS[0]
    want = pair.alone(probe)
    short = {**pair.greedy, "max_new_tokens": N // 2}
    long = {**pair.greedy, "max_new_tokens": 2 * N}
    mixes = [
        [probe, {"prompt": PROMPTS[1], **short}, {"prompt": PROMPTS[2], **long}],
        [{"prompt": PROMPTS[3], **long}, probe],
        [{"prompt": PROMPTS[4], **short}, {"prompt": PROMPTS[5], **short}, probe],
    ]
    for mix in mixes:
        results, spy = together(pair.many, mix, **pair.greedy)
        at = next(i for i, r in enumerate(mix) if r == probe)
        assert list(results[at].token_ids) == want, mix
        sizes = {len(rows) for rows in spy.decodes()}
        assert max(sizes) == len(mix)  # they did share forward passes
        for request, result in zip(mix, results, strict=True):
            if request != probe:
                prompt, own = request["prompt"], request["max_new_tokens"]  # type: ignore[index]
                assert list(result.token_ids) == pair.alone(prompt, max_new_tokens=own)


# -- prefix reuse ------------------------------------------------------------------------------


def test_a_prompt_goes_to_the_slot_holding_its_prefix_and_reads_as_alone(pair: Pair) -> None:
    long_a, long_b = WORDS, WORDS.upper()
    first, _ = together(pair.many, [long_a, long_b], **pair.greedy)  # slots 0 and 1
    assert ids(first) == [pair.alone(long_a), pair.alone(long_b)]
    for again in (long_b + "again", long_a + "and again"):
        with spied(pair.many) as spy:
            result = pair.many.generate(again, **pair.greedy)
        reused = result.stats.reused_prompt_tokens
        assert reused >= 2 * REUSE_GRANULE and reused % REUSE_GRANULE == 0, reused
        slot = 1 if again.startswith(long_b) else 0
        assert {e[1] for e in spy.prefills()} == {slot}
        assert spy.prefills()[0][3] == reused  # its cache was kept up to there
        assert list(result.token_ids) == pair.alone(again)
    with spied(pair.many) as spy:  # no prefix anywhere: the lowest free slot
        fresh = pair.many.generate("zz" + WORDS, **pair.greedy)
    assert fresh.stats.reused_prompt_tokens == 0 and {e[1] for e in spy.prefills()} == {0}
    assert list(fresh.token_ids) == pair.alone("zz" + WORDS)


# -- prompts read in chunks --------------------------------------------------------------------


def test_a_long_prompt_joins_in_chunks_while_another_decodes(pair: Pair) -> None:
    """A 200-token prompt arriving while a reply decodes is read in chunks of at most 64
    tokens, cut at multiples of REUSE_GRANULE, a decode step between them; both replies are
    what they give alone."""
    running_prompt, long_prompt = PROMPTS[1], LONG
    running_sampling = {**pair.greedy, "max_new_tokens": 4 * N}
    with spied(pair.many) as spy:
        held = spy.hold("decode")
        running = pair.many.stream(running_prompt, **running_sampling)
        reader, running_out = in_thread(running.collect)
        wait_for(lambda: spy.decodes(), "the running reply's first decode step")
        joiner, long_out = in_thread(lambda: pair.many.generate(long_prompt, **pair.greedy))
        wait_for(lambda: sum(pair.many.activity[k] for k in ("busy", "queued")) == 2, "both in")
        held.set()
        joiner.join(300)
        reader.join(300)
    (running_slot,) = {e[1] for e in spy.prefills()[:1]}
    chunks = [e for e in spy.prefills() if e[1] != running_slot]
    n_long = sum(e[2] for e in chunks)
    assert len(chunks) > 1 and all(e[2] <= 64 for e in chunks), chunks
    assert chunks[0][3] == 0  # nothing of it was in a cache
    assert all((e[3] + e[2]) % REUSE_GRANULE == 0 for e in chunks[:-1]), chunks
    assert chunks[-1][3] + chunks[-1][2] == n_long  # the chunks are the whole prompt, in order
    kinds = spy.kinds()
    first, last = spy.log.index(chunks[0]), spy.log.index(chunks[-1])
    assert "decode" in kinds[first:last], kinds  # the running reply decoded meanwhile
    assert list(long_out[0].token_ids) == pair.alone(long_prompt)
    assert list(running_out[0].token_ids) == pair.alone(running_prompt, max_new_tokens=4 * N)


# -- cancellation --------------------------------------------------------------------------------


def test_cancelling_one_reply_leaves_the_others_as_alone_and_frees_its_slot(pair: Pair) -> None:
    """Three replies decode together; one is cancelled while a step over all three is in
    flight: it ends "cancelled", the other two are what they give alone, and its slot takes
    the next request."""
    sampling = {**pair.greedy, "max_new_tokens": 2 * N}
    streams = [pair.many.stream(p, **sampling) for p in PROMPTS[:3]]
    with spied(pair.many) as spy:
        prefill_gate, decode_gate = spy.hold("prefill"), spy.hold("decode")
        readers = [in_thread(s.collect) for s in streams]
        wait_for(lambda: sum(pair.many.activity[k] for k in ("busy", "queued")) == 3, "in")
        prefill_gate.set()  # the three prompts are read together, then a step over all three
        wait_for(lambda: any(len(rows) == 3 for rows in spy.decodes()), "a step of three")
        streams[1].cancel()
        decode_gate.set()
        for thread, _ in readers:
            thread.join(300)
    results = [out[0] for _, out in readers]
    assert results[1].finish_reason == "cancelled"
    assert results[1].stats.completion_tokens < 2 * N
    for i in (0, 2):
        assert results[i].finish_reason == "length"
        assert list(results[i].token_ids) == pair.alone(PROMPTS[i], max_new_tokens=2 * N)
    wait_for(lambda: idle(pair.many), "every slot free")
    after, spy = together(pair.many, PROMPTS[3:6], **pair.greedy)
    assert ids(after) == [pair.alone(p) for p in PROMPTS[3:6]]
    assert {e[1] for e in spy.prefills()} == {0, 1, 2}  # the cancelled one's slot too


# -- the default model's ONNX route ------------------------------------------------------------


@pytest.mark.model
def test_default_model_onnx_rows_of_batches_of_two_or_more_agree_among_themselves() -> None:
    """The ONNX route of the default model is not batch-invariant against a row run alone
    (README "Exactness"), but a request gives the same tokens in any batch of two or more:
    here beside companions that outlast it, in two different mixes and slots."""
    with edgeinfer.load(
        "smollm2-135m-instruct", parallel=3, threads=2, context_length=256
    ) as model:
        assert model.info["backend"] == "onnxruntime", model.info["route"]
        greedy = {"temperature": 0, "max_new_tokens": 48}
        longer = {**greedy, "max_new_tokens": 64, "logit_bias": no_end(model)}
        texts = ["Water boils at", "The capital of France is", "def fibonacci(n):", "Hi"]
        for probe in texts[:3]:
            others = [t for t in texts if t != probe]
            mix = [probe, {"prompt": others[0], **longer}, {"prompt": others[1], **longer}]
            first, spy = together(model, mix, **greedy)
            steps = first[0].stats.completion_tokens - 1  # the probe's decode steps
            assert all(len(rows) >= 2 for rows in spy.decodes()[:steps])  # never a row alone
            second, spy = together(model, [{"prompt": others[2], **longer}, probe], **greedy)
            steps = second[1].stats.completion_tokens - 1
            assert all(len(rows) >= 2 for rows in spy.decodes()[:steps])
            assert first[0].token_ids == second[1].token_ids, probe
