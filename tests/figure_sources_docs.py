"""Where the figures of docs/memory.md and docs/converting.md come from (see figure_sources)."""

from __future__ import annotations

from typing import Any

from tests.figure_values import (
    Expr,
    each,
    hi,
    lo,
    matched,
    results,
    total,
    under,
)
from tests.figures import (
    Spec,
    Src,
    bare,
    frac_pct,
    gb_bytes,
    given,
    load,
    mb,
    mb_bytes,
    ms,
    pct,
    sec,
    spec,
    times,
    tps,
    us,
)

MEM = "docs/memory.md"
CONV = "docs/converting.md"
GGUF = results("memory-gguf.json")
BUDGETS = results("memory-budgets.json")
CTX256 = results("memory-context256-gguf.json")
INT8 = results("memory-onnx-int8.json")
TRIM = results("onnx_memory_trim.json")
KV16 = results("onnx_memory_kv16.json")
SESSIONS = results("onnx_memory_sessions.json")
LONG = {c: results(f"onnx_memory_long_{c}.json") for c in ("2048", "8192")}
TINY = {f: results(f"onnx_memory_tiny_{f}.json") for f in ("llama", "qwen2", "gemma3")}
PREFILL = results("kv16_prefill.json")
AGREE16 = results("agreement_kv16.json")
KV16_SPEED = results("onnx_kv16_speed.json")
IDLE = results("busy_cpu_idle.json")
AGREE = results("agreement.json")
BATCH_JOB = results("batch_job.json")
PREFILL_RATE = results("prefill_rate.json")
UNTOUCHED = results("onnx_memory_untouched.json")
KV_PAGES = results("kv_pages.json")
VALID = results("onnx-validation.json")
INT4 = results("int4_route.json")
CONVERT = results("gguf_convert.json")
QUANTS = results("gguf_quants.json")
ONE_LOOP = results("one_loop.json")
SPECULATIVE = results("speculative.json")
SPEC_TASKS = ("summarize", "extract", "rewrite", "edit", "chat")
PEER = results("llama_cpp_speculative.json")
GG15 = results("speculative-1.5b-gguf.json")
ONNX15 = results("speculative-1.5b-onnx.json")
ROUTE_READS = results("route_reads.json")


def _costs15(f: Any) -> Any:
    """The pass costs a 1.5B run measured at load: ``_costs15(GG15)("step_ms")``."""
    return lambda *keys: f("rounds", 0, "info", "pass_costs", *keys)


def _auto15(f: Any, route: str, task: str) -> Expr:
    return f("summary", route, f"{task}/auto", "decode_ratio_median")


PEER_ONNX = results("llama_cpp_speculative_onnx.json")
LONE = results("lone_steps.json")
LONE8 = results("lone_steps_8.json")
FIRST_BURST = results("first_burst.json")
PAR_SPEC = results("parallel_speculative.json")
PEER_SERVE = results("serve_parallel_peer.json")
BATCHED = results("llama_batched.json")
PEER15 = results("llama_cpp_speculative_1.5b.json")
NOISE = results("verify_noise.json")
SERVE_SPEC = results("serve_parallel_speculative.json")
STEP = results("step_overhead.json")
OG = results("bench-parallel-og.json")
OPS = results("onnx_op_profile.json")
_STEP1 = under(OPS, "passes", 0)
_OG_ROWS = under(OG, "reports", "onnxruntime", "results")


def _og_ratio(n: str, which: str = "ratio") -> Expr:
    return OG(
        "targets", f"onnxruntime: edgeinfer / og.Engine, aggregate decode, {n} streams", which
    )


_STEP_ONNX, _STEP_LLAMA = under(STEP, "routes", 0), under(STEP, "routes", 1)
_DRAFT = "edgeinfer draft:qwen2.5-coder-0.5b-instruct"


def _requests_parted(route: str, setting: str) -> Expr:
    """Requests of one route and setting whose greedy tokens parted from plain decoding's."""
    tasks = [under(SPECULATIVE, "summary", route, f"{t}/{setting}") for t in SPEC_TASKS]
    return total(each(*[t("requests") * (1 - t("identical_to_plain")) for t in tasks]))


def _largest_margin() -> Expr:
    """The largest plain-decoding margin (either sign) at any parting, over every route."""
    margins = each(
        *[
            SPECULATIVE("summary", r, f"{t}/{s}", "divergence_margins", "*")
            for r in ("gguf", "onnx")
            for t in SPEC_TASKS
            for s in ("lookup", "auto")
        ]
    )
    return hi(each(hi(margins), 0 - lo(margins)))


def _best_grounded(route: str) -> Expr:
    """The best task median of lookup and auto on summaries, rewrites and edits, one route."""
    return hi(
        each(
            *[
                SPECULATIVE("summary", route, f"{t}/{s}", "decode_ratio_median")
                for t in ("summarize", "rewrite", "edit")
                for s in ("lookup", "auto")
            ]
        )
    )


def _draft_over_plain(task: str) -> Expr:
    """The draft model's median decode rate over plain decoding's, on one task."""
    return PEER15("summary", task, _DRAFT) / PEER15("summary", task, "edgeinfer off")


_EI8, _LS8 = under(PEER_SERVE, "parallel", "8"), under(PEER_SERVE, "llama-server", "8")

A_SETTING = "a setting"


def _plan_row(f, i: int, budget) -> list:
    """A row of the memory-plan table: budget, context, batch, at load, planned, peak, error."""
    case = under(f, "cases", i)
    return [
        budget(case("plan", "budget")),
        bare(case("plan", "context_length")),
        bare(case("plan", "batch_size")),
        mb_bytes(case("plan", "loaded")),
        mb_bytes(case("plan", "total")),
        mb_bytes(case("peak_rss")),
        frac_pct(case("error_vs_peak")),
    ]


def _onnx_row(f, context: str) -> list:
    """A row of the ONNX-route tables: three peaks (MB) and two ratios to llama-cpp-python."""
    s = under(f, "summary_mb", context)
    return [
        mb(s("onnx-native", "peak_rss")),
        mb(s("onnx-native-kv16", "peak_rss")),
        mb(s("llama-cpp-python", "peak_rss")),
        bare(s("native_peak_over_llama_cpp_python")),
        bare(s("native_kv16_peak_over_llama_cpp_python")),
    ]


def _starts_ends(*files) -> object:
    return each(
        *(f("load_average_start", 0) for f in files), *(f("load_average_end", 0) for f in files)
    )


_PAIRS = (
    "llama.cpp f16 KV vs llama.cpp f32 KV",
    "llama.cpp f16 KV vs native ONNX",
    "llama.cpp f32 KV vs native ONNX",
)


def _pair_row(pair: str) -> list:
    p = under(AGREE, "pairs", pair)
    return [
        bare(p("top1_agreement")),
        bare(p("greedy_agreement")),
        bare(p("decisive_top1_agreement")),
        bare(p("decisive_positions")),
        bare(p("greedy_agreement_beyond_ties")),
        bare(p("mean_kl")),
        bare(p("relative_kl")),
    ]


def _int4_row(graph: str, ratio: str | None, speed: bool = True) -> list:
    fid = under(INT4, "fidelity", graph)
    row = [frac_pct(fid("top1_agreement")), bare(fid("mean_kl")), bare(fid("greedy_prefix_mean"))]
    if speed:
        row.append(bare(INT4("speed", graph, "decode_tok_s_median")))
    if ratio:
        row.append(times(INT4("decode_ratio", f"{ratio} / ortgenai-int4", "median")))
    return row


def _quant_row(i: int) -> list:
    r = under(QUANTS, "rows", i)
    return [
        mb(r("size_mb")),
        pct(r("top1_agreement_pct")),
        pct(r("greedy_agreement_pct")),
        bare(r("mean_kl")),
        frac_pct(QUANTS("rows", i, "report", "decisive_top1_agreement")),
    ]


def _validation_row(quant: str) -> list:
    r = under(VALID, "rows", quant)
    return [pct(r("top1_agreement_pct")), pct(r("greedy_agreement_pct")), bare(r("mean_kl"))]


def _prefill(model: str) -> object:
    return PREFILL("results", {"model": model, "prompt_tokens": 1024}, "pp_tok_s", "median")


def _kv16_speed(engine: str) -> object:
    return KV16_SPEED("summary", "2048", engine, "decode_tok_s")


def _one_loop_route(route: str) -> list:
    """this / baseline decode tok/s, the median ratio and its range, of one route."""
    return [
        tps(ONE_LOOP("summary", route, "this_decode_tok_s")),
        bare(ONE_LOOP("summary", route, "baseline_decode_tok_s")),
        times(ONE_LOOP("summary", route, "decode_ratio_median")),
        times(ONE_LOOP("summary", route, "decode_ratio_range", 0)),
        times(ONE_LOOP("summary", route, "decode_ratio_range", 1)),
    ]


def _spec_ratio(route: str, task: str, setting: str) -> Src:
    return times(SPECULATIVE("summary", route, f"{task}/{setting}", "decode_ratio_median"))


A_TARGET = "a target of the speculative-decoding issue"


def _peer_row(task: str, peer: Any = PEER) -> list[Src]:
    """edgeinfer plain and auto, the peer's ngram-simple, and auto over it, of one task."""
    row = under(peer, "summary", task)
    return [
        tps(row("edgeinfer off")),
        tps(row("edgeinfer auto")),
        tps(row("llama.cpp ngram-simple")),
        times(row("auto / ngram-simple")),
    ]


DOCS_SPECS: list[Spec] = [
    spec(
        "docs/speculative.md",
        "- Through the server: `python benchmarks/serve_parallel.py --parallel 8",
        tps(SERVE_SPEC("edgeinfer --speculative auto", "8", "aggregate_tok_s", "median")),
        tps(SERVE_SPEC("parallel", "8", "aggregate_tok_s", "median")),
        tps(SERVE_SPEC("edgeinfer --speculative auto", "8", "first_burst", "aggregate_tok_s")),
        tps(SERVE_SPEC("parallel", "8", "first_burst", "aggregate_tok_s")),
        load(SERVE_SPEC("conditions", "load_before", 0)),
        load(SERVE_SPEC("conditions", "load_after", 0)),
    ),
    spec(
        "docs/speculative.md",
        "Greedy replies part from plain decoding's in many requests",
        bare(_largest_margin()),
    ),
    spec(
        "docs/speculative.md",
        "How large that noise is: `python benchmarks/verify_noise.py`",
        bare(NOISE("routes", 0, "max_diff", "median")),
        bare(NOISE("routes", 0, "max_diff", "max")),
        bare(NOISE("routes", 0, "margin_moved", "max")),
        bare(NOISE("routes", 0, "margin_moved", "p99")),
        bare(NOISE("routes", 1, "max_diff", "median")),
        bare(NOISE("routes", 1, "max_diff", "max")),
        bare(NOISE("routes", 1, "margin_moved", "max")),
        bare(NOISE("routes", 1, "margin_moved", "p99")),
        bare(hi(NOISE("routes", 0, "margins_where_it_differs", "*"))),
        bare(hi(NOISE("routes", 1, "margins_where_it_differs", "*"))),
    ),
    spec(
        "docs/speculative.md",
        "| target | measured | results file | met |",
        times(_best_grounded("onnx")),
        times(_best_grounded("gguf")),
        _spec_ratio("onnx", "extract", "auto"),
        _spec_ratio("gguf", "extract", "auto"),
        _spec_ratio("gguf", "chat", "auto"),
        _spec_ratio("onnx", "chat", "auto"),
        times(lo(each(*[_draft_over_plain(t) for t in SPEC_TASKS]))),
        times(hi(each(*[_draft_over_plain(t) for t in SPEC_TASKS]))),
        times(_draft_over_plain("chat")),
        times(lo(each(*[PEER_ONNX("summary", t, "auto / ngram-simple") for t in SPEC_TASKS[:4]]))),
        times(hi(each(*[PEER_ONNX("summary", t, "auto / ngram-simple") for t in SPEC_TASKS[:4]]))),
        times(PEER_ONNX("summary", "chat", "auto / ngram-simple")),
        times(lo(each(*[PEER("summary", t, "auto / ngram-simple") for t in SPEC_TASKS]))),
        times(hi(each(*[PEER("summary", t, "auto / ngram-simple") for t in SPEC_TASKS]))),
        times(
            lo(each(*[PEER15("summary", t, f"{_DRAFT[10:]} / draft-simple") for t in SPEC_TASKS]))
        ),
        times(
            hi(each(*[PEER15("summary", t, f"{_DRAFT[10:]} / draft-simple") for t in SPEC_TASKS]))
        ),
        times(lo(each(*[PEER15("summary", t, "auto / ngram-simple") for t in SPEC_TASKS]))),
        times(hi(each(*[PEER15("summary", t, "auto / ngram-simple") for t in SPEC_TASKS]))),
    ),
    spec(
        "docs/speculative.md",
        "- **On two cores the 0.5B draft's step is a large share of the 1.5B's**",
        times(ONNX15("summary", "onnx", f"extract/{_DRAFT[10:]}", "decode_ratio_median")),
    ),
    spec(
        "docs/speculative.md",
        "- **On the 135M default model the drafts are kept seldom**",
        given("2x", A_TARGET),
    ),
    spec(
        "docs/speculative.md",
        "| task (ONNX route) | edgeinfer plain | edgeinfer `auto` |",
        *[f for task in SPEC_TASKS for f in _peer_row(task, PEER_ONNX)],
    ),
    spec(
        "docs/speculative.md",
        "| task (llama.cpp route) | edgeinfer plain | edgeinfer `auto` |",
        *[f for task in SPEC_TASKS for f in _peer_row(task)],
    ),
    spec(
        "docs/speculative.md",
        "on the same task and file: met on",
        given("1.2x", A_TARGET),
        given("89.0 tok/s", "the previous run of the same command, replaced by its file"),
        given("0.95x", "the previous run of the same command, replaced by its file"),
    ),
    spec(
        "docs/speculative.md",
        "The default model, 10 prompts for each of five tasks",
        tps(SPECULATIVE("summary", "gguf", "plain_decode_tok_s_median")),
        tps(SPECULATIVE("summary", "onnx", "plain_decode_tok_s_median")),
    ),
    spec(
        "docs/speculative.md",
        "| task | llama.cpp `lookup` | llama.cpp `auto` |",
        *[
            _spec_ratio(route, task, setting)
            for task in SPEC_TASKS
            for route in ("gguf", "onnx")
            for setting in ("lookup", "auto")
        ],
    ),
    spec(
        "docs/speculative.md",
        "Against this round's targets: `auto` on open chat keeps",
        _spec_ratio("gguf", "chat", "auto"),
        _spec_ratio("onnx", "chat", "auto"),
        given("0.97x", A_TARGET),
        _spec_ratio("onnx", "extract", "auto"),
        given("1.5x", A_TARGET),
        given("1.68x", "the previous run of the same command, replaced by this file"),
        _spec_ratio("gguf", "extract", "auto"),
        times(hi(each(_best_grounded("gguf"), _best_grounded("onnx")))),
        given("2x", A_TARGET),
    ),
    spec(
        "docs/speculative.md",
        "- **What a pass costs.** The same file records each engine's measured passes",
        *[
            times(SPECULATIVE("rounds", i, "info", "pass_costs", "pass_over_step", k))
            for i in (0, 1)  # the first round: onnx, then gguf
            for k in ("1", "4", "8")
        ],
        given("2.74x", "the previous run of the same command, replaced by this file"),
    ),
    spec(
        "docs/speculative.md",
        "- At any `parallel`: speculation runs inside the one generation loop",
        times(PAR_SPEC("summary", "auto", "ratio_to_off_median")),
        times(PAR_SPEC("summary", "auto", "ratio_to_off_range", 0)),
        times(PAR_SPEC("summary", "auto", "ratio_to_off_range", 1)),
        given("157 tok/s", "the lower group of the runs' aggregates in the same file, rounded"),
        given("207 tok/s", "the upper group of the runs' aggregates in the same file, rounded"),
        given("0.86x", "the previous run of the same command, replaced by this file"),
    ),
    spec(
        "docs/many-requests.md",
        "The server from its first burst, beside llama.cpp's own server",
        tps(_EI8("first_burst", "aggregate_tok_s")),
        tps(_LS8("first_burst", "aggregate_tok_s")),
        times(_EI8("first_burst", "aggregate_tok_s") / _LS8("first_burst", "aggregate_tok_s")),
        given("1.5x", "the target of the many-requests issue, from the first burst"),
        load(PEER_SERVE("machine", "loadavg_at_start", 0)),
        tps(_EI8("aggregate_tok_s", "median")),
        tps(_LS8("aggregate_tok_s", "median")),
        times(_EI8("aggregate_tok_s", "median") / _LS8("aggregate_tok_s", "median")),
        tps(_EI8("aggregate_tok_s", "min")),
        tps(_EI8("aggregate_tok_s", "max")),
        tps(_LS8("aggregate_tok_s", "min")),
        tps(_LS8("aggregate_tok_s", "max")),
        given("191 tok/s", "a run before the previous one, replaced by this file"),
        given("134 tok/s", "a run before the previous one, replaced by this file"),
        given("1.43x", "a run before the previous one, replaced by this file"),
        times(_EI8("join", "joined_over_alone", "median")),
    ),
    spec(
        "docs/speculative.md",
        "| task | edgeinfer plain | edgeinfer `draft:` |",
        *[
            f
            for task in SPEC_TASKS
            for f in (
                tps(PEER15("summary", task, "edgeinfer off")),
                tps(PEER15("summary", task, _DRAFT)),
                times(_draft_over_plain(task)),
                tps(PEER15("summary", task, "llama.cpp draft-simple")),
                times(PEER15("summary", task, f"{_DRAFT[10:]} / draft-simple")),
            )
        ],
    ),
    spec(
        "docs/speculative.md",
        "The draft must read the whole prompt before its first proposal",
        given("3%", "the target of the speculative-decoding issue for auto on open chat"),
        times(lo(each(*[_draft_over_plain(t) for t in SPEC_TASKS]))),
        times(hi(each(*[_draft_over_plain(t) for t in SPEC_TASKS]))),
        times(
            lo(each(*[PEER15("summary", t, f"{_DRAFT[10:]} / draft-simple") for t in SPEC_TASKS]))
        ),
        times(
            hi(each(*[PEER15("summary", t, f"{_DRAFT[10:]} / draft-simple") for t in SPEC_TASKS]))
        ),
        given("0.78x", "the previous run of the same command, before the catch-up rule"),
        given("0.86x", "the previous run of the same command, before the catch-up rule"),
    ),
    spec(
        "docs/speculative.md",
        "| pass over | llama.cpp | onnxruntime (exact transcode) |",
        ms(_costs15(GG15)("step_ms")),
        ms(_costs15(ONNX15)("step_ms")),
        *[bare(_costs15(f)("pass_over_step", k)) for k in ("1", "4", "8") for f in (GG15, ONNX15)],
    ),
    spec(
        "docs/speculative.md",
        "On llama.cpp's CPU kernels a pass costs nearly a step per token",
        times(lo(each(*[_auto15(GG15, "gguf", t) for t in SPEC_TASKS]))),
        times(hi(each(*[_auto15(GG15, "gguf", t) for t in SPEC_TASKS]))),
        tps(GG15("summary", "gguf", "plain_decode_tok_s_median")),
        times(_auto15(ONNX15, "onnx", "summarize")),
        times(_auto15(ONNX15, "onnx", "extract")),
        times(_auto15(ONNX15, "onnx", "rewrite")),
        tps(ONNX15("summary", "onnx", "plain_decode_tok_s_median")),
        times(ROUTE_READS("reads", "qwen2.5-coder-1.5b-instruct", "transcode_reads")),
        times(ONNX15("summary", "onnx", f"extract/{_DRAFT[10:]}", "decode_ratio_median")),
    ),
    spec(
        "docs/many-requests.md",
        "On llama.cpp's own route (the GGUF kept on llama.cpp)",
        tps(BATCHED("summary", "edgeinfer", "decode_tok_s_median")),
        tps(BATCHED("summary", "llama-batched-bench", "decode_tok_s_median")),
        times(BATCHED("summary", "ratio_median")),
        times(BATCHED("summary", "ratio_range", 0)),
        times(BATCHED("summary", "ratio_range", 1)),
        ms(_STEP_LLAMA("forward_ms_median")),
        ms(_STEP_LLAMA("between_ms_median")),
        frac_pct(_STEP_LLAMA("between_share")),
        ms(_STEP_LLAMA("forward_ms_median") + _STEP_LLAMA("between_ms_median")),
        tps(8000 / (_STEP_LLAMA("forward_ms_median") + _STEP_LLAMA("between_ms_median"))),
        ms(_STEP_ONNX("forward_ms_median")),
        ms(_STEP_ONNX("between_ms_median")),
        frac_pct(_STEP_ONNX("between_share")),
        given("9%", "1 - the ratio 0.91x above, rounded"),
        times(BATCHED("summary", "ratio_range", 0)),
        times(BATCHED("summary", "ratio_range", 1)),
    ),
    spec(
        "docs/many-requests.md",
        "Beside onnxruntime-genai's `og.Engine` with real prompts",
        ms(_OG_ROWS(3, "ttft_pooled_ms", "p50")),
        ms(_OG_ROWS(2, "ttft_pooled_ms", "p50")),
        ms(_OG_ROWS(2, "join_ttft_ms", "mean")),
        ms(_OG_ROWS(3, "join_ttft_ms", "mean")),
    ),
    spec(
        "docs/many-requests.md",
        "| 8 streams, mean of 5 runs | edgeinfer | og.Engine | edgeinfer ÷ og.Engine |",
        tps(_OG_ROWS(2, "done_tok_s", "mean")),
        tps(_OG_ROWS(3, "done_tok_s", "mean")),
        times(_og_ratio("8", "start_to_end_ratio")),
        tps(_OG_ROWS(2, "tg_tok_s", "mean")),
        tps(_OG_ROWS(3, "tg_tok_s", "mean")),
        times(_og_ratio("8")),
        mb(_OG_ROWS(2, "peak_rss_mb", "max")),
        mb(_OG_ROWS(3, "peak_rss_mb", "max")),
    ),
    spec(
        "docs/many-requests.md",
        "The second leaves out the time og.Engine spends reading prompts",
        given("1.0x", "the target of the many-requests issue against og.Engine"),
        tps(_OG_ROWS(0, "tg_tok_s", "mean")),
        tps(_OG_ROWS(1, "tg_tok_s", "mean")),
        times(_og_ratio("1")),
        times(_og_ratio("1", "start_to_end_ratio")),
        frac_pct(_STEP1("offset_share")),
        ms(_STEP1("kind_us_median", "MatMul (Q4_1 offsets)") / 1000),
        ms(_STEP1("kind_us_median", "Add (Q4_1 offsets)") / 1000),
        ms(_STEP1("kind_us_median", "MatMulNBits 4-bit/32") / 1000),
        ms(_STEP1("kind_us_median", "MatMulNBits 8-bit/32") / 1000),
        ms(_STEP1("kind_us_median", "GroupQueryAttention") / 1000),
    ),
    spec(
        MEM,
        "**The KV cache takes pages only where it is written.**",
        given("2 MiB", "a head's row at 8,192 positions: 8192 x 64 x 4 bytes"),
        given("128 MiB", "WHOLE_CACHE_LIMIT in runtimes/onnx_slots.py"),
        load(UNTOUCHED("load_average_start", 0)),
        mb(UNTOUCHED("summary_mb", "8192", "onnx-native", "peak_rss")),
        mb(UNTOUCHED("summary_mb", "8192", "llama-cpp-python", "peak_rss")),
        times(UNTOUCHED("summary_mb", "8192", "native_peak_over_llama_cpp_python")),
        given("1.05x", "a target"),
        mb(UNTOUCHED("summary_mb", "2048", "onnx-native", "peak_rss")),
        mb(UNTOUCHED("summary_mb", "2048", "llama-cpp-python", "peak_rss")),
        times(UNTOUCHED("summary_mb", "2048", "native_peak_over_llama_cpp_python")),
        mb(UNTOUCHED("summary_mb", "2048", "onnx-native", "load_peak_rss")),
    ),
    spec(
        MEM,
        "| case | peak RSS | first burst after load | later bursts' decode |",
        *[
            times(KV_PAGES("summary", case, "ratio_to_numpy", "untouched", key))
            for case in ("one stream at 8192", "8 streams at 2048")
            for key in ("peak_rss_mb", "first_burst_tok_s", "later_tok_s")
        ],
    ),
    spec(
        "docs/many-requests.md",
        "A batch job against a loop of `chat()` on the same route",
        sec(lo(BATCH_JOB("rounds", "*", "batch_job_s"))),
        sec(hi(BATCH_JOB("rounds", "*", "batch_job_s"))),
        sec(lo(BATCH_JOB("rounds", "*", "loop_job_s"))),
        sec(hi(BATCH_JOB("rounds", "*", "loop_job_s"))),
        times(BATCH_JOB("median_speedup")),
        times(lo(BATCH_JOB("rounds", "*", "speedup"))),
        times(hi(BATCH_JOB("rounds", "*", "speedup"))),
        frac_pct(lo(BATCH_JOB("rounds", "*", "labels_same"))),
        given("1.30x", "an earlier single round of the same job, replaced by this file"),
        given("4x", "a target"),
        tps(PREFILL_RATE("lengths", 2, "prefill_tok_s")),
        tps(PREFILL_RATE("lengths", 6, "prefill_tok_s")),
        ms(PREFILL_RATE("lengths", 2, "median_ttft_s") * 1000),
    ),
    spec(
        "docs/many-requests.md",
        "The price of pairing, for one stream",
        times(LONE("results", 0, "paired_over_alone_median")),
        times(LONE("results", 1, "paired_over_alone_median")),
    ),
    spec(
        "docs/many-requests.md",
        "The price of pairing at 8 streams",
        load(LONE8("conditions", "load_before", 0)),
        tps(LONE8("results", 0, "paired_median_tok_s")),
        tps(LONE8("results", 0, "alone_median_tok_s")),
        times(LONE8("results", 0, "paired_over_alone_median")),
        times(LONE8("results", 0, "paired_over_alone_range", 0)),
        times(LONE8("results", 0, "paired_over_alone_range", 1)),
        given("5%", "the many-requests issue's budget for batch invariance"),
    ),
    spec(
        "docs/many-requests.md",
        "No cold shapes: `python benchmarks/first_burst.py",
        load(FIRST_BURST("conditions", "load_before", 0)),
        *[
            f
            for c in ("512", "2048")
            for f in (
                tps(FIRST_BURST("summary", c, "first_burst_tok_s")),
                tps(FIRST_BURST("summary", c, "later_tok_s")),
                times(FIRST_BURST("summary", c, "first_over_later")),
                tps(FIRST_BURST("summary", c, "later_range_tok_s", 0)),
                tps(FIRST_BURST("summary", c, "later_range_tok_s", 1)),
            )
        ],
        *[
            f
            for c in ("512", "2048")
            for f in (
                ms(FIRST_BURST("summary", c, "first_ttft_s") * 1000),
                ms(FIRST_BURST("summary", c, "later_ttft_s") * 1000),
                times(FIRST_BURST("summary", c, "first_ttft_over_later")),
            )
        ],
        *[
            ms(
                (
                    FIRST_BURST("summary", c, "first_ttft_s")
                    - FIRST_BURST("summary", c, "later_ttft_s")
                )
                * 1000
            )
            for c in ("512", "2048")
        ],
    ),
    spec(
        "docs/performance.md",
        "There is one generation loop: the slot engine",
        *_one_loop_route("gguf"),
        *_one_loop_route("onnx"),
        us(ONE_LOOP("summary", "free", "this", "us_per_token_median")),
        us(ONE_LOOP("summary", "free", "baseline", "us_per_token_median")),
        given("8 ms", "the decode rates above, as milliseconds per token"),
        given("9 ms", "the decode rates above, as milliseconds per token"),
    ),
    spec(MEM, "- **Plan**: the process now", given("2x", "a formula (2 x layers x ...)")),
    spec(
        MEM,
        "- **Margin**: 4 MiB + 2% of the plan",
        given("4 MiB", A_SETTING),
        given("2%", A_SETTING),
        given("5%", A_SETTING),
        given("2 MiB", A_SETTING),
        given("5%", A_SETTING),
    ),
    spec(
        MEM, "Measured with `python benchmarks/bench_memory.py --budgets", given("95%", A_SETTING)
    ),
    spec(
        MEM,
        "| model | budget | context | batch | at load |",
        *(_plan_row(GGUF, i, mb_bytes) for i in range(3)),
        _plan_row(INT8, 1, mb_bytes),
        _plan_row(INT8, 2, gb_bytes),
        _plan_row(INT8, 3, gb_bytes),
    ),
    spec(
        MEM,
        "With the route rule, the default model by its catalog name",
        load(BUDGETS("conditions", "load_before", 0)),
    ),
    spec(
        MEM,
        "| budget | route | context | at load | planned | peak RSS |",
        mb(matched(BUDGETS("cases", 0, "error"), r"needs (\d+) MB")),
        given("256", "the least context a plan offers (plan.MIN_CONTEXT)"),
        mb(matched(BUDGETS("cases", 1, "route", "route", "why"), r"needs (\d+) MB")),
        bare(BUDGETS("cases", 1, "context_length")),
        mb_bytes(BUDGETS("cases", 1, "plan", "loaded")),
        mb_bytes(BUDGETS("cases", 1, "planned")),
        mb_bytes(BUDGETS("cases", 1, "peak_rss")),
        bare(BUDGETS("cases", 2, "context_length")),
        mb_bytes(BUDGETS("cases", 2, "plan", "loaded")),
        mb_bytes(BUDGETS("cases", 2, "planned")),
        mb_bytes(BUDGETS("cases", 2, "peak_rss")),
    ),
    spec(
        MEM,
        "256 MB and 512 MB hold their peak under the budget; 192 MB does not load",
        given("256 MB", "a budget of the table above"),
        given("512 MB", "a budget of the table above"),
        given("192 MB", "a budget of the table above"),
        mb_bytes(CTX256("cases", 0, "peak_rss")),
        load(CTX256("conditions", "load_before", 0)),
        mb_bytes(CTX256("cases", 0, "planned")),
        mb(matched(BUDGETS("cases", 0, "error"), r"needs (\d+) MB")),
        given("192 MB", "a budget of the table above"),
    ),
    spec(
        MEM,
        "The int8 plan counts its 113 MB fp32 embedding",
        given("113 MB", "computed: 49,152 x 576 float32 weights"),
        mb(matched(INT8("cases", 0, "budget"), r"(\d+)MB")),
        mb(matched(INT8("cases", 0, "error"), r"needs (\d+) MB")),
    ),
    spec(
        MEM,
        "`edgeinfer devices MODEL --inventory tests/data/machines/raspberry",
        given("1 GB", "a board's RAM"),
        given("1 GB", "a board's RAM"),
    ),
    spec(
        MEM,
        "**The ONNX route beside llama.cpp.**",
        load(TRIM("load_average_start", 0)),
        load(hi(TRIM("runs", "*", "load_after"))),
    ),
    spec(MEM, "| 2048 | 306.3 MB |", _onnx_row(TRIM, "2048"), _onnx_row(TRIM, "8192")),
    spec(
        MEM,
        "Peak resident set (`VmHWM`). What changed this round",
        mb(KV16("summary_mb", "2048", "onnx-native", "peak_rss")),
        bare(SESSIONS("session_summary_mb", "no-prepacking", "decode_tok_s")),
        tps(SESSIONS("session_summary_mb", "default", "decode_tok_s")),
        load(lo(_starts_ends(KV16, SESSIONS, *TINY.values()))),
        load(hi(_starts_ends(KV16, SESSIONS, *TINY.values()))),
        *(times(TINY[f]("summary_mb", "256", "native_peak_over_llama_cpp_python")) for f in TINY),
    ),
    spec(
        MEM,
        "A prompt that fills the context moves every engine's peak",
        load(lo(_starts_ends(*LONG.values()))),
        load(hi(_starts_ends(*LONG.values()))),
    ),
    spec(
        MEM, "| 2048 | 419.6 MB |", _onnx_row(LONG["2048"], "2048"), _onnx_row(LONG["8192"], "8192")
    ),
    spec(
        MEM,
        "onnxruntime's CPU attention on a float16 cache",
        tps(_prefill("b179c9523d0e6a0f-native-v3-kv16")),
        tps(_prefill("b179c9523d0e6a0f-native-v3")),
    ),
    spec(
        MEM,
        "The plan stays above the peak on both routes",
        bare(TRIM("summary_mb", "2048", "onnx-native", "planned")),
        mb(TRIM("summary_mb", "8192", "onnx-native", "planned")),
        bare(TRIM("summary_mb", "2048", "onnx-native-kv16", "planned")),
        mb(TRIM("summary_mb", "8192", "onnx-native-kv16", "planned")),
        bare(LONG["2048"]("summary_mb", "2048", "onnx-native-kv16", "planned")),
        mb(LONG["8192"]("summary_mb", "8192", "onnx-native-kv16", "planned")),
    ),
    spec(
        MEM,
        "**float16 KV: fidelity and speed.**",
        bare(AGREE16("pairs", _PAIRS[1], "top1_agreement")),
        bare(AGREE16("pairs", _PAIRS[2], "top1_agreement")),
        bare(AGREE16("pairs", _PAIRS[1], "greedy_agreement_beyond_ties")),
        bare(AGREE16("pairs", _PAIRS[0], "top1_agreement")),
        load(AGREE16("load_average", "before", 0)),
        bare(AGREE16("load_average", "after", 0)),
        load(KV16_SPEED("load_average_start", 0)),
        load(KV16_SPEED("load_average_end", 0)),
        tps(_kv16_speed("onnx-native-kv16")),
        tps(_kv16_speed("onnx-native")),
        times(_kv16_speed("onnx-native-kv16") / _kv16_speed("onnx-native")),
        tps(lo(KV16_SPEED("runs", "*", "decode_tok_s"))),
        tps(hi(KV16_SPEED("runs", "*", "decode_tok_s"))),
        tps(_kv16_speed("onnx-native")),
        tps(IDLE("summary", {"route": "onnxruntime", "hogs": 0}, "median_decode_tok_s", "default")),
    ),
    spec(
        CONV,
        "The verdict does not count near-ties.",
        given("0.5", A_SETTING),
        given("0.5", A_SETTING),
        given("0.90", "a default (--min-top1)"),
        given("0.60", "a default (--min-greedy)"),
        given("0.05", A_SETTING),
    ),
    spec(
        CONV,
        "| quant | top-1 agreement | greedy agreement | mean KL | passes |",
        *(_validation_row(q) for q in ("fp32", "int8wo", "int8", "int4")),
    ),
    spec(
        CONV,
        "int8 is ONNX Runtime's dynamic quantization with 7-bit",
        frac_pct(VALID("rows", "int8", "report", "greedy_agreement_beyond_ties")),
    ),
    spec(
        CONV,
        "Through the native builder (`keep`), the reference is llama.cpp",
        load(AGREE("load_average", "before", 0)),
        load(hi(AGREE("load_average", "*", 0))),
    ),
    spec(
        CONV,
        "| pair | top-1 | greedy | decisive top-1 (positions) |",
        *(_pair_row(p) for p in _PAIRS),
    ),
    spec(
        CONV,
        "**The lossy int4 route.**",
        bare(INT4("float_source", "vs_genai_source", "ffn_max_abs_diff")),
    ),
    spec(
        CONV,
        "Measured against llama.cpp on the F32 source, teacher-forced",
        load(lo(each(INT4("load_at_start"), INT4("load_at_end")))),
        load(hi(each(INT4("load_at_start"), INT4("load_at_end")))),
    ),
    spec(
        CONV,
        "| graph | top-1 agreement | mean KL | greedy prefix |",
        _int4_row("exact", "exact"),
        _int4_row("int4-search-head8", "int4-search-head8"),
        _int4_row("int4-search", "int4-search"),
        _int4_row("int4-rtn-head8", None, speed=False),
        _int4_row("ortgenai-int4", None),
    ),
    spec(
        CONV,
        "Against the issue's targets: agreement at least genai's",
        frac_pct(INT4("fidelity", "int4-search-head8", "top1_agreement")),
        frac_pct(INT4("fidelity", "ortgenai-int4", "top1_agreement")),
        bare(INT4("fidelity", "int4-search-head8", "mean_kl")),
        bare(INT4("fidelity", "ortgenai-int4", "mean_kl")),
        times(INT4("decode_ratio", "int4-search-head8 / ortgenai-int4", "median")),
        times(INT4("decode_ratio", "int4-search / ortgenai-int4", "median")),
        times(lo(INT4("decode_ratio", "int4-search / ortgenai-int4", "rounds"))),
        frac_pct(INT4("fidelity", "int4-search", "top1_agreement")),
        frac_pct(INT4("fidelity", "int4-rtn-head8", "top1_agreement")),
        sec(INT4("quantize_embedding", "cpu_s")),
    ),
    spec(
        CONV,
        "The GGUF writer needs neither torch nor a llama.cpp checkout",
        mb_bytes(CONVERT("checkpoint_bytes")),
        mb_bytes(CONVERT("peak_write")),
        sec(CONVERT("write_s")),
    ),
    spec(
        CONV,
        "Checked on the default model (`tests/test_convert_gguf.py`)",
        load(lo(each(QUANTS("load_average_before"), QUANTS("load_average_after")))),
        load(hi(each(QUANTS("load_average_before"), QUANTS("load_average_after")))),
    ),
    spec(
        CONV,
        "| quant | size | top-1 agreement | greedy agreement |",
        *(_quant_row(i) for i in range(3)),
    ),
]

TRANSCODE = results("transcode_memory.json")
_TRANSCODE_ROWS = ((0, "keep"), (0, "keep_before"), (1, "keep"), (1, "keep_before"))


def _transcode_row(source: int, run: str) -> list:
    r = under(TRANSCODE, "sources", source, run)
    return [
        gb_bytes(r("source_bytes")),
        gb_bytes(r("folder_bytes")),
        times(r("folder_ratio")),
        gb_bytes(r("peak_rss")),
        times(r("peak_rss_ratio")),
        sec(r("seconds")),
    ]


def _alternative_row(source: int, run: str) -> list:
    r = under(TRANSCODE, "sources", source, run)
    return [
        times(r("folder_ratio")),
        frac_pct(r("agreement_with_keep", "top1_agreement")),
        bare(r("agreement_with_keep", "max_abs_logit_diff")),
    ]


_TRANSCODE_LOADS = each(
    TRANSCODE("conditions", "load_before", 0), TRANSCODE("conditions", "load_after", 0)
)
_ARITHMETIC = "a block layout's bytes divided by the GGUF block's (gguf_blocks' table)"
DOCS_SPECS += [
    spec(
        CONV,
        "Both Qwen2.5-Coder Q4_K_M files, each conversion",
        load(lo(_TRANSCODE_LOADS)),
        load(hi(_TRANSCODE_LOADS)),
    ),
    spec(
        CONV,
        "| conversion | GGUF | folder | folder / GGUF | peak RSS |",
        *(_transcode_row(i, run) for i, run in _TRANSCODE_ROWS),
    ),
    spec(
        CONV,
        "The memory target (peak at most 1.5x the file)",
        given("1.5x", "the issue's target"),
        given("1.1x", "the issue's target"),
        given("1.33x", _ARITHMETIC),
        given("1.52x", _ARITHMETIC),
        given("1.64x", _ARITHMETIC),
    ),
    spec(
        CONV,
        "| conversion | folder / GGUF | top-1 agreement with `keep` |",
        *(_alternative_row(i, run) for i in (0, 1) for run in ("int4-head8", "int4")),
    ),
]
