"""The memory plan: sizes, fit, refusals, recorded machines, and peak RSS under a budget."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import edgeinfer
from edgeinfer import cli
from edgeinfer.config import LoadConfig
from edgeinfer.errors import InvalidRequestError, MemoryBudgetError
from edgeinfer.generation.delivery import Submitted
from edgeinfer.generation.results import Chunk, KVHistory
from edgeinfer.generation.sampling import Sampler, SamplingConfig
from edgeinfer.generation.scheduler import Engine
from edgeinfer.loader import resolve
from edgeinfer.machine.inventory import build_inventory
from edgeinfer.machine.probes import RecordedProbe
from edgeinfer.memory.plan import (
    FRESH_PROCESS_BYTES,
    THREAD_BYTES,
    FitAtLoad,
    parse_size,
    plan_memory,
)
from edgeinfer.memory.rss import resident_with_mapped_files
from edgeinfer.memory.shape import shape_of
from tests.fakes import FakeBackend

MACHINES = Path(__file__).parent / "data" / "machines"
MB = 10**6


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MB", 512 * 10**6),
        ("512 mb", 512 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("800M", 800 * 10**6),
        ("64MiB", 64 * 2**20),
        ("1048576", 2**20),
        (2**20, 2**20),
    ],
)
def test_parse_size(text: Any, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "-5MB", "0", 0, -1, True, "5 XB", "1.2.3GB"])
def test_parse_size_rejects_nonsense(bad: Any) -> None:
    with pytest.raises(InvalidRequestError, match="memory_budget"):
        parse_size(bad)


@pytest.fixture(scope="module")
def gguf_shape(default_gguf: Path) -> Any:
    return shape_of(resolve(default_gguf))


def test_gguf_shape_from_the_header(gguf_shape: Any) -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, f16 cache -> 23,040 bytes per token
    assert gguf_shape.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert gguf_shape.trained_context == 8192
    assert 90 * 2**20 < gguf_shape.weight_bytes < 100 * 2**20
    assert (gguf_shape.n_heads, gguf_shape.n_vocab) == (9, 49152)


def test_a_plan_adds_up(gguf_shape: Any) -> None:
    plan = plan_memory(gguf_shape, budget="512MB", process=40 * MB, engine_loaded=True)
    parts = plan.process + plan.weights + plan.engine + plan.kv_cache + plan.compute
    assert plan.total == parts + plan.headroom <= plan.budget
    assert plan.kv_cache == 23040 * plan.context_length
    assert plan.context_length % 256 == 0 or plan.context_length == 8192
    assert plan.to_dict()["total"] == plan.total
    assert "of 512 MB (memory_budget)" in plan.describe()


def test_smaller_budgets_give_smaller_contexts(gguf_shape: Any) -> None:
    contexts = [
        plan_memory(gguf_shape, budget=b, process=40 * MB, engine_loaded=True).context_length
        for b in ("200MB", "256MB", "400MB", "1GB")
    ]
    assert contexts == sorted(contexts) and contexts[0] < contexts[-1] == 8192


def test_tiny_budget_is_refused_with_the_numbers(gguf_shape: Any) -> None:
    with pytest.raises(MemoryBudgetError) as info:
        plan_memory(gguf_shape, budget="64MB")
    text = str(info.value)
    assert "budget is 64 MB" in text and "needs" in text and "weights" in text
    assert "bigger memory_budget" in text


def test_context_that_does_not_fit_is_refused(gguf_shape: Any) -> None:
    with pytest.raises(MemoryBudgetError, match="shorter context_length") as info:
        plan_memory(gguf_shape, budget="256MB", context_length=8192)
    assert "8192-token context" in str(info.value)
    with pytest.raises(InvalidRequestError, match="trained context"):
        plan_memory(gguf_shape, budget="1GB", context_length=16384)


def test_refusals_happen_before_loading(
    default_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a backend was opened")

    monkeypatch.setattr("edgeinfer.runtimes.open_backend", never)
    with pytest.raises(MemoryBudgetError):
        edgeinfer.load(default_gguf, memory_budget="64MB")
    with pytest.raises(MemoryBudgetError):
        edgeinfer.load(default_gguf, memory_budget="256MB", context_length=8192)
    with pytest.raises(InvalidRequestError):
        edgeinfer.load(default_gguf, memory_budget="a lot")


def test_no_budget_on_this_machine_takes_the_trained_context(default_gguf: Path) -> None:
    with edgeinfer.load(default_gguf) as model:
        plan = model.info["memory_plan"]
        assert plan["budget_source"].startswith("50% of the")
        assert model.context_length == plan["context_length"] and plan["total"] <= plan["budget"]
        assert plan["context_length"] % 256 == 0
        # the full 8192-token context needs about 510 MB (README, "Memory"): with room for it,
        # it is what a load without a budget takes; a low-RAM machine gets less, not an error
        if plan["budget"] >= 600e6:
            assert plan["context_length"] == 8192
        result = model.generate("Hello", max_new_tokens=4, temperature=0)
        assert result.stats.peak_rss_bytes > 100 * MB


def _machine_plan(name: str, shape: Any) -> Any:
    record = json.loads((MACHINES / f"{name}.json").read_text())
    inv = build_inventory(RecordedProbe(record))
    return plan_memory(
        shape, available=inv.available_ram, process=FRESH_PROCESS_BYTES, engine_loaded=False
    )


def test_plans_for_recorded_raspberry_pis(gguf_shape: Any, default_onnx: Any) -> None:
    int8 = shape_of(resolve(default_onnx("int8")))
    # Raspberry Pi 5, 8 GB: everything fits at full speed
    plan = _machine_plan("raspberry-pi-5", gguf_shape)
    assert (plan.context_length, plan.batch_size) == (8192, 512)
    # Pi 4 with 1 GB, desktop running (480 MB available, budget 240 MB + the process):
    # the GGUF model gets a smaller context; the ONNX int8 conversion does not fit (its fp32
    # embedding is mapped and counted in full: any prompt may read every row)
    plan = _machine_plan("raspberry-pi-4-1gb-desktop", gguf_shape)
    assert 2048 <= plan.context_length < 8192 and plan.total <= plan.budget
    with pytest.raises(MemoryBudgetError, match="480 MB available"):
        _machine_plan("raspberry-pi-4-1gb-desktop", int8)
    # Pi 4 with 1 GB, no desktop (712 MB available): the 135M GGUF model fits its whole
    # trained context by taking a smaller prefill batch; the ONNX int8 one still does not fit
    plan = _machine_plan("raspberry-pi-4-1gb", gguf_shape)
    assert plan.context_length == 8192 and plan.batch_size < 512
    with pytest.raises(MemoryBudgetError, match="712 MB available"):
        _machine_plan("raspberry-pi-4-1gb", int8)


def test_cli_memory_budget(default_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["run", str(default_gguf), "-p", "Hi", "--memory-budget", "64MB"])
    assert code == 1
    assert "budget is 64 MB" in capsys.readouterr().err
    args = ["devices", str(default_gguf), "--inventory", str(MACHINES / "raspberry-pi-5.json")]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "memory plan:" in out and "context 8192 tokens, batch 512" in out


# -- a full context: stop, or slide ---------------------------------------------------------


def run(backend: FakeBackend, history: KVHistory, prompt: list[int], sampler: Sampler,
        cancel: threading.Event, slide_keep: int | None = None) -> Iterator[Chunk]:  # fmt: skip
    """One request through the generation loop, stepped in this thread (as at parallel=1)."""
    engine = Engine(backend, threaded=False, history=history)
    return engine.run(Submitted(prompt, sampler, cancel, slide_keep))


def test_full_context_stops_with_length() -> None:
    backend = FakeBackend(n_ctx=32)
    cfg = SamplingConfig(temperature=0, max_new_tokens=100, logit_bias={0: -100.0})
    chunks = list(run(backend, KVHistory(), [5, 6, 7], Sampler(cfg, 300), _never()))
    assert chunks[-1].finish_reason == "length"
    assert 3 + sum(len(c.token_ids) for c in chunks) == 32
    assert backend.n_past <= 32


def test_sliding_context_keeps_the_start_and_goes_on() -> None:
    backend = FakeBackend(n_ctx=32)
    history = KVHistory()
    cfg = SamplingConfig(temperature=0, max_new_tokens=100, logit_bias={0: -100.0})
    prompt = [5, 6, 7, 8]
    chunks = list(run(backend, history, prompt, Sampler(cfg, 300), _never(), slide_keep=2))
    generated = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].finish_reason == "length" and len(generated) == 100  # max_new_tokens
    assert history.tokens[:2] == [5, 6]  # the kept start
    assert history.tokens[-1] == generated[-2]  # the last token is sampled, not decoded
    assert len(history.tokens) < 32 and backend.n_past == len(history.tokens)


@pytest.mark.model
def test_sliding_chat_on_the_default_model(default_gguf: Path) -> None:
    messages = [
        {"role": "system", "content": "You are a pirate. Always answer like a pirate."},
        {"role": "user", "content": "Tell me a very long story about the sea."},
    ]
    with edgeinfer.load(default_gguf, context_length=256, context_overflow="slide") as model:
        system = model._chat_ids(messages[:1], add_generation_prompt=False)
        eos = model._tokenizer.is_end_of_generation
        ban = {t: -100.0 for t in range(3) if eos(t)}
        result = model.chat(messages, max_new_tokens=400, temperature=0, logit_bias=ban)
        assert result.finish_reason == "length" and result.stats.completion_tokens == 400
        kept = model._history.tokens[: len(system) - 1]
        assert kept == system[: len(system) - 1]
        assert model._history.tokens and len(model._history.tokens) < 256
    with edgeinfer.load(default_gguf, context_length=256) as model:
        result = model.chat(messages, max_new_tokens=400, temperature=0, logit_bias=ban)
        assert result.finish_reason == "length" and result.stats.completion_tokens < 256
    with pytest.raises(InvalidRequestError, match="context_overflow"):
        edgeinfer.load(default_gguf, context_overflow="wrap")


def _never() -> Any:
    import threading

    return threading.Event()


# -- measured at load -------------------------------------------------------------------------


def test_a_mapped_file_counts_in_full(tmp_path: Path) -> None:
    import mmap

    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * (16 * 2**20))
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
        assert view[0] == 0  # a few pages resident (read-around), 16 MiB mapped
        files = (str(path.resolve()),)
        counted = resident_with_mapped_files(files)
        plain = resident_with_mapped_files(())
    if counted is None or plain is None:
        pytest.skip("no /proc/self/smaps here")
    # counted - plain = the mapping's pages not resident yet
    assert 8 * 2**20 <= counted - plain <= 16 * 2**20


def _fit_at_load(
    shape: Any, *, budget: str, loaded: int, fixed: int | None = None
) -> tuple[Any, Any, int]:
    plan = plan_memory(
        shape, budget=budget, context_length=fixed, process=40 * MB, engine_loaded=True
    )
    fit = FitAtLoad(shape, plan, fixed_context=fixed is not None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("edgeinfer.memory.plan.resident_with_mapped_files", lambda files: loaded)
        mp.setattr("edgeinfer.memory.plan.peak_rss", lambda: loaded)  # the load peak
        config = LoadConfig(context_length=plan.context_length, fit_context=fit)
        context = config.context_for(shape.trained_context)
    return plan, fit.plan, context


def test_the_context_is_refitted_to_what_the_load_measured(gguf_shape: Any) -> None:
    estimate, _, _ = _fit_at_load(gguf_shape, budget="256MB", loaded=0)
    # the engine took 20 MB more than estimated (weights repacked for this CPU, say)
    more = estimate.resident_before_kv + 20 * MB
    _, plan, context = _fit_at_load(gguf_shape, budget="256MB", loaded=more)
    assert plan.loaded == more and plan.context_length == context < estimate.context_length
    assert plan.total <= plan.budget and plan.batch_size == estimate.batch_size
    assert "measured at load" in plan.describe()
    # and 20 MB less: the freed memory goes to the context
    _, plan, context = _fit_at_load(gguf_shape, budget="256MB", loaded=more - 40 * MB)
    assert context > estimate.context_length and plan.total <= plan.budget


def test_a_fixed_context_that_no_longer_fits_is_refused(gguf_shape: Any) -> None:
    with pytest.raises(MemoryBudgetError, match="resident once the weights were loaded"):
        _fit_at_load(gguf_shape, budget="256MB", loaded=250 * MB, fixed=1024)
    _, plan, context = _fit_at_load(gguf_shape, budget="256MB", loaded=150 * MB, fixed=1024)
    assert context == plan.context_length == 1024


def test_a_load_that_passed_the_budget_is_refused(gguf_shape: Any) -> None:
    with pytest.raises(MemoryBudgetError, match="at its peak"):
        _fit_at_load(gguf_shape, budget="256MB", loaded=300 * MB)


def test_the_margin_grows_with_threads_and_context(gguf_shape: Any) -> None:
    def plan(threads: int, ctx: int) -> Any:
        return plan_memory(
            gguf_shape, budget="1GB", context_length=ctx, process=40 * MB, engine_loaded=True,
            threads=threads,
        )  # fmt: skip

    assert plan(4, 1024).compute - plan(1, 1024).compute == 3 * THREAD_BYTES
    assert plan(1, 4096).headroom > plan(1, 1024).headroom


# -- peak RSS under a budget, in a fresh process -----------------------------------------------

CHILD = r"""
import json, sys
import edgeinfer
from edgeinfer.memory.rss import peak_rss
model, budget, threads, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with edgeinfer.load(model, memory_budget=budget, threads=threads) as llm:
    n_ctx, n_vocab = llm.context_length, llm.info["vocab_size"]
    if prompt == "spread":  # ids all over the vocabulary: many embedding rows read
        ids = [(i * 7919) % n_vocab for i in range(n_ctx - 32)]
    else:
        unit = llm.tokenize("The quick brown fox jumps over the lazy dog. ")
        ids = (unit * (n_ctx // len(unit) + 1))[: n_ctx - 32]
    result = llm.generate(ids, max_new_tokens=64, temperature=0,
                          logit_bias={t: -100.0 for t in (0, 1, 2)})
    plan = llm.info["memory_plan"]
    print(json.dumps({"context": n_ctx, "finish": result.finish_reason,
                      "stats_peak": result.stats.peak_rss_bytes, "peak": peak_rss(),
                      "planned": plan["total"], "loaded": plan["loaded"]}))
"""


def _run_under(model: Path, budget: str, threads: int, prompt: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), budget, str(threads), prompt],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _smallest_budget(model: Path, threads: int) -> int:
    """The smallest budget the plan accepts for a fresh process (a 256-token context)."""
    return plan_memory(
        shape_of(resolve(model)), context_length=256, process=FRESH_PROCESS_BYTES,
        engine_loaded=False, budget="100GB", threads=threads,
    ).total  # fmt: skip


def _check_peaks(model: Path, threads: int, extra: int) -> None:
    """Peak <= budget at the smallest accepted budget (a prompt spread over the whole
    vocabulary) and ``extra`` bytes above it (a larger context; a repeated sentence); the
    context is filled each time."""
    smallest = _smallest_budget(model, threads)
    contexts = []
    for budget, prompt in ((int(smallest * 1.03), "spread"), (smallest + extra, "sentence")):
        out = _run_under(model, str(budget), threads, prompt)
        print(threads, budget, out)
        assert out["peak"] <= budget, out
        assert out["planned"] <= budget and out["loaded"] is not None
        assert out["stats_peak"] <= out["peak"]
        assert out["finish"] == "length"  # the context was filled
        contexts.append(out["context"])
    assert contexts == sorted(contexts) and contexts[0] >= 256


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_gguf_peak_rss_stays_within_the_budget(default_gguf: Path, threads: int) -> None:
    _check_peaks(default_gguf, threads, extra=32 * MB)


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_onnx_int8_peak_rss_stays_within_the_budget(default_onnx: Any, threads: int) -> None:
    _check_peaks(default_onnx("int8"), threads, extra=64 * MB)


def test_absurd_sizes_are_invalid_not_a_crash() -> None:
    for bad in ("1" * 400, "1e400GB", "99999999999TB"):
        with pytest.raises(InvalidRequestError):
            parse_size(bad)


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_native_onnx_peak_rss_stays_within_the_budget(default_gguf: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    folder = tmp_path / "native"
    folder.mkdir()
    write_gguf_folder(default_gguf, folder, max_context=2048)
    _check_peaks(folder, 2, extra=64 * MB)
