"""load(parallel=...): the values it takes, the memory plan for N sequence slots, "auto", the
refusal that names the parts, the route rule for a catalog GGUF, a real load at parallel=2,
and the peak RSS of 4 concurrent sequences under a budget."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.config import LoadConfig
from edgeinfer.errors import InvalidRequestError, MemoryBudgetError, ModelLoadError
from edgeinfer.files import catalog
from edgeinfer.loader import resolve, route_for, runs_as_onnx
from edgeinfer.machine.routes import ENGINES, choose_route
from edgeinfer.memory.costs import COSTS, SLOT_LOGITS_BYTES
from edgeinfer.memory.plan import (
    AUTO_MAX_PARALLEL,
    AUTO_MIN_CONTEXT,
    FRESH_PROCESS_BYTES,
    MIN_CONTEXT,
    FitAtLoad,
    check_parallel,
    plan_memory,
)
from edgeinfer.memory.shape import ModelShape, shape_of

MB = 10**6
MiB = 2**20

# The default model's shape (SmolLM2-135M), as its GGUF header and native ONNX folder say.
GGUF = ModelShape(
    format="gguf", quantization="default", weight_bytes=95 * MiB, n_layers=30, n_heads=9,
    n_kv_heads=3, head_dim_k=64, head_dim_v=64, kv_element_bytes=2, n_vocab=49152,
    trained_context=8192,
)  # fmt: skip
NATIVE = dataclasses.replace(
    GGUF, format="onnx", quantization="gguf-blocks", kv_element_bytes=4, kv_cache="shared",
    logits_all_positions=False, tokenizer_bytes=2 * MiB,
)  # fmt: skip
SHAPES = {"gguf": GGUF, "native": NATIVE}


def plan(shape: ModelShape = GGUF, **kw: Any) -> Any:
    kw.setdefault("process", 40 * MB)
    kw.setdefault("engine_loaded", True)
    kw.setdefault("threads", 2)
    return plan_memory(shape, **kw)


# -- the values parallel takes -----------------------------------------------------------------

ANY_VALUE = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.booleans(), st.none(),
    st.text(max_size=12), st.binary(max_size=8), st.lists(st.integers(1, 4), max_size=3),
    st.sampled_from(["auto", "AUTO", " auto", "4", "8", "max", "", "1.0", 4.0, 2 + 0j]),
)  # fmt: skip


def _valid(value: Any) -> bool:
    if value == "auto" and isinstance(value, str):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 256


@settings(max_examples=300, deadline=None)
@given(ANY_VALUE)
def test_load_checks_parallel_before_any_work(value: Any) -> None:
    """A bad parallel is refused with the fix, before the model is even looked up; a good
    one passes the check (and the missing model is what fails then)."""
    expected = ModelLoadError if _valid(value) else InvalidRequestError
    with pytest.raises(expected) as info:
        edgeinfer.load("no-such-model-here", parallel=value)
    if not _valid(value):
        text = str(info.value)
        assert text.startswith(f"parallel={value!r} is invalid")
        assert "integer from 1 to 256" in text and "'auto'" in text


@settings(max_examples=200, deadline=None)
@given(ANY_VALUE)
def test_check_parallel_and_load_config_agree(value: Any) -> None:
    good = _valid(value) and value != "auto"
    try:
        got = check_parallel(value)
    except InvalidRequestError:
        got = None
    try:
        LoadConfig(parallel=value)
        config_ok = True
    except InvalidRequestError:
        config_ok = False
    assert (got is not None) == good == config_ok
    if good:
        assert got == value


@settings(max_examples=100, deadline=None)
@given(st.one_of(ANY_VALUE, st.sampled_from(ENGINES)))
def test_load_checks_engine(value: Any) -> None:
    expected = (
        ModelLoadError if value in ENGINES and isinstance(value, str) else InvalidRequestError
    )
    with pytest.raises(expected) as info:
        edgeinfer.load("no-such-model-here", engine=value)
    if expected is InvalidRequestError:
        assert "'llama.cpp' or 'onnxruntime'" in str(info.value)


# -- the plan's arithmetic ---------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.integers(150 * MB, 4000 * MB), st.sampled_from(sorted(SHAPES)))
def test_one_slot_is_the_plan_of_one_sequence(budget: int, kind: str) -> None:
    shape = SHAPES[kind]
    try:
        alone = plan(shape, budget=budget)
    except MemoryBudgetError:
        with pytest.raises(MemoryBudgetError):
            plan(shape, budget=budget, parallel=1)
        return
    one = plan(shape, budget=budget, parallel=1)
    assert one == alone and one.parallel == 1 and one.kv_cache == one.kv_per_slot


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("slots", [2, 4, 8])
def test_n_slots_hold_n_caches_and_the_largest_step(kind: str, slots: int) -> None:
    shape = SHAPES[kind]
    costs = COSTS["onnx-shared" if kind == "native" else "gguf"]
    one = plan(shape, budget="20GB", context_length=1024)
    many = plan(shape, budget="20GB", context_length=1024, parallel=slots)
    assert (many.parallel, many.context_length, many.batch_size) == (slots, 1024, one.batch_size)
    assert many.kv_per_slot == one.kv_cache == shape.kv_bytes_per_token * 1024
    assert many.kv_cache == slots * many.kv_per_slot
    # the compute grows by the decoding rows' scores over their slot's context and logits
    rows = slots - 1
    extra = costs.score_bytes * rows * 1024 * shape.n_heads + SLOT_LOGITS_BYTES * rows * 49152
    assert abs(many.compute - one.compute - extra) <= 1
    parts = many.resident_before_kv + many.kv_cache + many.compute + many.headroom
    assert many.total == parts <= many.budget
    shown = many.to_dict()
    assert shown["parallel"] == slots and shown["kv_cache"] == many.kv_cache
    assert shown["kv_per_slot"] == many.kv_per_slot and shown["total"] == many.total
    assert f"{slots} slots x 1024 tokens" in many.describe()
    assert f"beside {slots - 1} decoding sequences" in many.describe()


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_more_slots_share_the_budget_with_shorter_contexts(kind: str) -> None:
    plans = [plan(SHAPES[kind], budget="700MB", parallel=n) for n in (1, 2, 4, 8)]
    contexts = [p.context_length for p in plans]
    assert contexts == sorted(contexts, reverse=True) and contexts[0] > contexts[-1]
    assert all(p.total <= p.budget and p.context_length >= MIN_CONTEXT for p in plans)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(100 * MB, 3000 * MB),
    st.integers(1, 16),
    st.sampled_from([None, 256, 1024, 4096]),
    st.sampled_from(sorted(SHAPES)),
)
def test_a_plan_fits_or_is_refused(budget: int, slots: int, ctx: int | None, kind: str) -> None:
    try:
        got = plan(SHAPES[kind], budget=budget, parallel=slots, context_length=ctx)
    except MemoryBudgetError as exc:
        _check_refusal(str(exc), budget, slots, ctx, SHAPES[kind])
        return
    assert got.total <= budget and got.parallel == slots
    assert got.context_length == ctx if ctx else got.context_length >= MIN_CONTEXT
    if ctx is None and got.context_length < 8192:  # the largest context that fits
        with pytest.raises(MemoryBudgetError):
            plan(
                SHAPES[kind], budget=budget, parallel=slots, context_length=got.context_length + 256
            )


def _check_refusal(text: str, budget: int, slots: int, ctx: int | None, shape: ModelShape) -> None:
    """The refusal names the parts, their figures add up to what the plan needs, and the
    slot count it offers fits while one more does not."""
    needed = int(re.search(r"needs (\d+) MB", text).group(1))  # type: ignore[union-attr]
    parts = text.split(": ", 1)[1].split(";")[0]
    figures = [int(x) for x in re.findall(r"(\d+) MB", parts)]
    assert abs(sum(figures) - needed) <= len(figures)  # each rounded to a whole MB
    for name in ("weights", "KV cache", "compute", "activations", "runtime overhead", "process",
                 "engine", "headroom"):  # fmt: skip
        assert name in parts, (name, text)
    assert "bigger memory_budget" in text
    if slots > 1:
        assert f"{slots} slots of a" in text and "each slot's KV cache is" in text
    offered = re.search(r"use parallel=(\d+) \(the most slots of (\d+) tokens", text)
    if offered is None:
        if slots > 1:  # not even one slot fits
            with pytest.raises(MemoryBudgetError):
                plan(shape, budget=budget, context_length=ctx or MIN_CONTEXT)
        return
    fewer, at = int(offered.group(1)), int(offered.group(2))
    assert 1 <= fewer < slots and at == (ctx or MIN_CONTEXT)
    assert plan(shape, budget=budget, parallel=fewer, context_length=at).total <= budget
    with pytest.raises(MemoryBudgetError):
        plan(shape, budget=budget, parallel=fewer + 1, context_length=at)


def test_the_refusal_says_what_to_change() -> None:
    with pytest.raises(MemoryBudgetError) as info:
        plan(GGUF, budget="500MB", parallel=8, context_length=4096)
    text = str(info.value)
    assert "8 slots of a 4096-token context" in text and "(8 slots x 4096 tokens)" in text
    assert "a 32-token prefill chunk beside 7 decoding sequences" in text
    assert "use parallel=" in text and "a shorter context_length" in text
    _check_refusal(text, 500 * MB, 8, 4096, GGUF)
    seven = plan(GGUF, budget="20GB", parallel=7, context_length=1024, batches=(32,)).total
    with pytest.raises(MemoryBudgetError, match=r"use parallel=7 \(the most slots of 1024 "):
        plan(GGUF, budget=seven, parallel=8, context_length=1024)
    with pytest.raises(MemoryBudgetError) as info:  # the budget cannot hold one slot
        plan(GGUF, budget="120MB", parallel=4)
    assert "use parallel=" not in str(info.value)


# -- parallel="auto" ---------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    st.integers(100 * MB, 4000 * MB),
    st.sampled_from([None, 512, 2048, 8192]),
    st.sampled_from(sorted(SHAPES)),
    st.sampled_from([8192, 1024]),
)
def test_auto_takes_the_most_slots_with_a_useful_context(
    budget: int, ctx: int | None, kind: str, trained: int
) -> None:
    shape = dataclasses.replace(SHAPES[kind], trained_context=trained)
    if ctx is not None and ctx > trained:
        ctx = trained
    useful = ctx or min(AUTO_MIN_CONTEXT, trained)
    try:
        got = plan(shape, budget=budget, parallel="auto", context_length=ctx)
    except MemoryBudgetError:  # then not even one slot fits
        with pytest.raises(MemoryBudgetError):
            plan(shape, budget=budget, context_length=ctx)
        return
    assert 1 <= got.parallel <= AUTO_MAX_PARALLEL and got.total <= budget
    assert got == plan(shape, budget=budget, parallel=got.parallel, context_length=ctx)
    if got.parallel > 1:
        assert got.context_length >= useful
    if got.parallel < AUTO_MAX_PARALLEL:  # one more slot would not keep a useful context
        try:
            more = plan(shape, budget=budget, parallel=got.parallel + 1, context_length=ctx)
        except MemoryBudgetError:
            return
        assert more.context_length < useful


def test_auto_on_a_roomy_and_a_tight_budget() -> None:
    roomy = plan(GGUF, budget="8GB", parallel="auto")
    assert (roomy.parallel, roomy.context_length) == (AUTO_MAX_PARALLEL, 8192)
    tight = plan(GGUF, budget="260MB", parallel="auto")
    assert tight.parallel == 1 and tight == plan(GGUF, budget="260MB")
    fixed = plan(NATIVE, budget="1GB", parallel="auto", context_length=4096)
    assert 1 < fixed.parallel < AUTO_MAX_PARALLEL and fixed.context_length == 4096


def test_the_context_refitted_at_load_keeps_the_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    estimate = plan(GGUF, budget="600MB", parallel=4)
    fit = FitAtLoad(GGUF, estimate, fixed_context=False)
    more = estimate.resident_before_kv + 30 * MB  # the engine took 30 MB more than estimated
    monkeypatch.setattr("edgeinfer.memory.plan.resident_with_mapped_files", lambda files: more)
    monkeypatch.setattr("edgeinfer.memory.plan.peak_rss", lambda: more)
    context = LoadConfig(parallel=4, fit_context=fit).context_for(8192)
    assert fit.plan.parallel == 4 and context == fit.plan.context_length
    assert context < estimate.context_length and fit.plan.total <= fit.plan.budget


# -- the route rule ----------------------------------------------------------------------------

ALL = ("llama_cpp", "onnxruntime", "onnx")


@pytest.mark.parametrize(
    ("parallel", "device", "installed", "engine", "llama_device", "expected"),
    [
        (1, "auto", ALL, "auto", "cpu", "onnx"),  # on the CPU: README "Busy machine"
        (1, "cpu", ALL, "auto", "cpu", "onnx"),
        (1, "auto", ("llama_cpp", "onnxruntime"), "auto", "cpu", "gguf"),  # no builder
        (1, "auto", ALL, "auto", "cuda", "gguf"),  # llama.cpp on a GPU
        (1, "cuda", ALL, "auto", "cpu", "gguf"),  # a GPU wish stays with llama.cpp
        (2, "auto", ALL, "auto", "cpu", "onnx"),  # batches better on the CPU
        (8, "cpu", ALL, "auto", "cpu", "onnx"),
        (8, "auto", ALL, "auto", "cuda", "gguf"),  # llama.cpp on a GPU batches there
        (8, "cuda", ALL, "auto", "cuda", "gguf"),
        (8, "metal", ALL, "auto", "metal", "gguf"),
        (8, "cpu", ALL, "llama.cpp", "cpu", "gguf"),  # the user's word
        (1, "cpu", ALL, "onnxruntime", "cpu", "onnx"),
        (8, "cpu", ("llama_cpp", "onnxruntime"), "auto", "cpu", "gguf"),  # no builder
        (8, "cpu", ("llama_cpp", "onnx"), "auto", "cpu", "gguf"),  # no onnxruntime
        (1, "auto", ("onnxruntime", "onnx"), "auto", "cpu", "onnx"),  # no llama.cpp
        (1, "npu", ALL, "auto", "cpu", "onnx"),  # a device only ONNX Runtime drives
        (4, "QNNExecutionProvider", ALL, "auto", "cpu", "onnx"),
    ],
)
def test_the_route_of_a_catalog_gguf(
    parallel: int, device: str, installed: tuple[str, ...], engine: str, llama_device: str,
    expected: str,
) -> None:  # fmt: skip
    route = choose_route(
        "gguf", transcodable=True, parallel=parallel, device=device, installed=installed,
        engine=engine, llama_device=llama_device,
    )  # fmt: skip
    assert route.format == expected and route.source == "gguf"
    shown = route.to_dict()
    assert shown == {"format": expected, "from": "gguf", "why": route.why} and route.why
    if expected == "onnx" and engine == "auto" and parallel > 1 and device in ("auto", "cpu"):
        assert f"parallel={parallel}" in route.why and "exact ONNX transcode" in route.why
    if expected == "gguf" and parallel > 1 and "onnx" not in installed:
        assert "onnx is not installed" in route.why


@pytest.mark.parametrize(
    "reads, parallel, engine, expected",
    [
        (1.16, 1, "auto", "onnx"),  # the default model's Q4_1: decodes level, answers sooner
        (1.30, 1, "auto", "onnx"),
        (1.40, 1, "auto", "gguf"),  # Q4_K_M files: Q6_K as 8-bit/16, K-quant offsets
        (1.40, 2, "auto", "onnx"),  # two sequences: the 0.5B's 1.53x, the 1.5B's 0.88x
        (1.40, 8, "auto", "onnx"),  # many sequences batch better on the transcode
        (1.40, 1, "onnxruntime", "onnx"),  # the user's word
    ],
)
def test_one_sequence_stays_on_llama_cpp_where_the_transcode_reads_far_more(
    reads: float, parallel: int, engine: str, expected: str
) -> None:
    route = choose_route(
        "gguf", transcodable=True, parallel=parallel, device="auto", installed=ALL,
        engine=engine, transcode_reads=reads,
    )  # fmt: skip
    assert route.format == expected
    if expected == "gguf":
        assert f"{reads:.2f}x the file's bytes" in route.why and "parallel > 1" in route.why


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 256),
    st.sampled_from(["auto", "cpu", "cuda", "metal", "gpu", "npu", "directml"]),
    st.sets(st.sampled_from(ALL)),
    st.sampled_from(["cpu", "cuda", "metal"]),
)
def test_a_gguf_file_named_by_its_path_stays_on_llama_cpp(
    parallel: int, device: str, installed: set[str], llama_device: str
) -> None:
    route = choose_route(
        "gguf", transcodable=False, parallel=parallel, device=device, installed=installed,
        llama_device=llama_device,
    )  # fmt: skip
    assert route.format == "gguf"
    forced = choose_route(
        "gguf", transcodable=True, parallel=parallel, device=device, installed=installed,
        engine="llama.cpp", llama_device=llama_device,
    )  # fmt: skip
    assert forced.format == "gguf"
    with pytest.raises(InvalidRequestError, match="catalog name"):
        choose_route(
            "gguf", transcodable=False, parallel=parallel, device=device, installed=installed,
            engine="onnxruntime",
        )  # fmt: skip
    onnx = choose_route("onnx", transcodable=False, parallel=parallel, device=device,
                        installed=installed)  # fmt: skip
    assert onnx.format == "onnx"
    with pytest.raises(InvalidRequestError, match="ONNX model"):
        choose_route("onnx", transcodable=False, parallel=parallel, device=device,
                     installed=installed, engine="llama.cpp")  # fmt: skip


def test_the_default_model_reads_little_more_than_its_file(default_gguf: Path) -> None:
    """Its Q4_1 transcode reads 1.16x the file a step: one sequence runs it."""
    source = resolve(catalog.DEFAULT_MODEL)
    assert route_for(catalog.DEFAULT_MODEL, source, "cpu").format == "onnx"


@pytest.mark.model
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_a_q4_k_m_catalog_file_decodes_one_sequence_on_llama_cpp(name: str) -> None:
    """Their transcodes read 1.39x and 1.40x the file a step (Q6_K and Q5_0 as 8-bit values,
    Q4_K with offsets): one sequence stays on llama.cpp, eight run the transcode."""
    source = resolve(name)
    one = route_for(name, source, "cpu")
    assert one.format == "gguf" and "the file's bytes a step" in one.why
    assert route_for(name, source, "cpu", parallel=8).format == "onnx"


def test_the_loader_asks_the_rule_with_this_machine(tiny_llama_gguf: Path) -> None:
    source = resolve(tiny_llama_gguf)
    assert route_for(tiny_llama_gguf, source, "cpu", parallel=8).format == "gguf"
    assert not runs_as_onnx(tiny_llama_gguf, source, "cpu", parallel=8)


# -- real loads --------------------------------------------------------------------------------


def test_a_tiny_model_at_parallel_2(tiny_llama_gguf: Path) -> None:
    # the budget bounds the whole process: leave 2 GB beside what this test process (a long
    # pytest session, with whatever earlier tests imported) already holds
    import psutil

    from edgeinfer.memory.rss import peak_rss

    # the load checks the process's peak, which earlier tests in a long session may have set
    budget = max(peak_rss(), psutil.Process().memory_info().rss) + 2 * 10**9
    with edgeinfer.load(tiny_llama_gguf, parallel=2, memory_budget=budget, threads=1) as model:
        assert model.parallel == 2 and model._backend.n_slots == 2
        info = model.info
        assert info["memory_plan"]["parallel"] == 2
        assert info["kv_cache_bytes"] == 2 * info["memory_plan"]["kv_per_slot"]
        assert info["route"] == {"format": "gguf", "from": "gguf",
                                 "why": "a GGUF file runs on llama.cpp"}  # fmt: skip
    with edgeinfer.load(tiny_llama_gguf, parallel="auto", memory_budget=budget) as model:
        assert model.parallel == model.info["memory_plan"]["parallel"] == AUTO_MAX_PARALLEL


def test_a_load_that_cannot_hold_its_slots_is_refused_before_loading(
    tiny_llama_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a backend was opened")

    monkeypatch.setattr("edgeinfer.runtimes.open_backend", never)
    shape = shape_of(resolve(tiny_llama_gguf))  # a 256-token trained context
    kw: dict[str, Any] = {"budget": "20GB", "context_length": 256, "process": 0}
    one, many = plan(shape, **kw), plan(shape, **kw, parallel=256)
    budget = (one.total + many.total) // 2  # one slot fits; 256 do not
    with pytest.raises(MemoryBudgetError, match="256 slots of a 256-token context"):
        edgeinfer.load(tiny_llama_gguf, parallel=256, context_length=256, memory_budget=budget)


# -- peak RSS of concurrent sequences under a budget, in a fresh process -----------------------

CHILD = r"""
import json, sys, threading
import edgeinfer
from edgeinfer.files import catalog
from edgeinfer.memory.rss import peak_rss
model, budget, slots = sys.argv[1], sys.argv[2], int(sys.argv[3])
with edgeinfer.load(model, memory_budget=budget, threads=2, parallel=slots) as llm:
    n_ctx, n_vocab = llm.context_length, llm.info["vocab_size"]
    results = [None] * slots
    def one(i):  # a prompt spread over the vocabulary: many embedding rows read
        ids = [(j * 7919 + i * 104729) % n_vocab for j in range(n_ctx - 32)]
        results[i] = llm.generate(ids, max_new_tokens=64, temperature=0,
                                  logit_bias={t: -100.0 for t in (0, 1, 2)})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(slots)]
    for t in threads: t.start()
    for t in threads: t.join()
    plan = llm.info["memory_plan"]
    print(json.dumps({"context": n_ctx, "parallel": llm.parallel, "peak": peak_rss(),
                      "planned": plan["total"], "budget": plan["budget"],
                      "finish": [r.finish_reason for r in results],
                      "tokens": [r.stats.completion_tokens for r in results]}))
"""


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_four_concurrent_sequences_stay_within_the_budget(default_gguf: Path) -> None:
    slots = 4
    smallest = plan(
        shape_of(resolve(default_gguf)), budget="100GB", context_length=512, parallel=slots,
        process=FRESH_PROCESS_BYTES, engine_loaded=False,
    ).total  # fmt: skip
    budget = int(smallest * 1.05)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(default_gguf), str(budget), str(slots)],
        capture_output=True, text=True, check=False, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(budget, out)
    assert out["parallel"] == slots and out["context"] >= 256
    assert out["planned"] <= out["budget"] == budget
    assert out["peak"] <= budget, out
    assert out["finish"] == ["length"] * slots  # every slot's context filled


@pytest.mark.model
def test_a_catalog_gguf_at_parallel_2_runs_its_onnx_transcode(default_gguf: Path) -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    kw: dict[str, Any] = {"parallel": 2, "context_length": 256, "threads": 1}
    with edgeinfer.load(catalog.DEFAULT_MODEL, **kw) as model:
        route = model.info["route"]
        assert (route["format"], route["from"]) == ("onnx", "gguf")
        assert "parallel=2" in route["why"] and model.parallel == 2
    with edgeinfer.load(catalog.DEFAULT_MODEL, engine="llama.cpp", **kw) as model:
        assert model.info["route"]["format"] == "gguf" and model.parallel == 2
