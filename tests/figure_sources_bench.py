"""Where the figures of docs/performance.md and benchmarks/README.md come from (see
figure_sources)."""

from __future__ import annotations

from tests.figure_values import (
    Field,
    each,
    hi,
    lo,
    results,
    total,
    under,
)
from tests.figures import (
    Spec,
    Src,
    bare,
    frac_pct,
    given,
    load,
    mb,
    ms,
    spec,
    times,
    tps,
)

PERF = "docs/performance.md"
BENCH = "benchmarks/README.md"
AGREEMENT_RUN = results("bench-agreement.json")
NATIVE = results("bench-native.json")
DEFAULT = results("bench-default.json")
INT8 = results("bench-int8.json")
PROFILE = results("native-onnx.json")
IDLE = results("busy_cpu_idle.json")
HOGS = results("busy_cpu_quiet_hogs.json")
BUSY = results("busy_cpu.json")
OMP = results("busy_cpu_omp_wait.json")
AGREE = results("agreement.json")
ROUTES = results("route_reads.json")
ROUTES2 = results("route_reads_2.json")
READS_MODELS = (
    "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b-instruct",
)


def _reads_row(model: str) -> list[Src]:
    """One row of the route-reads table: reads, one sequence and eight on both engines."""

    def one(*keys: str) -> Field:
        return ROUTES("summary", f"{model} parallel=1", *keys)

    def eight(*keys: str) -> Field:
        return ROUTES("summary", f"{model} parallel=8", *keys)

    return [
        times(ROUTES("reads", model, "transcode_reads")),
        tps(one("onnxruntime", "tg_tok_s")),
        tps(one("llama.cpp", "tg_tok_s")),
        times(one("decode_onnx_over_llama")),
        tps(eight("onnxruntime", "steady_tg_tok_s")),
        tps(eight("llama.cpp", "steady_tg_tok_s")),
        times(eight("decode_onnx_over_llama")),
    ]


SMOL = "smollm2-135m-instruct"
PEERS = ("edgeinfer", "llama-cpp-python", "onnxruntime-genai")
OPTIMUM = ("edgeinfer", "optimum", "onnxruntime-genai")


def bench_row(f, model: str, engine: str, prompt: int):
    return under(f, "results", {"model": model, "engine": engine, "prompt_tokens": prompt})


def bench_rows(f, rows: list[tuple[str, str, int]], agreement: bool = False) -> list[Src]:
    """The figures of `edgeinfer bench --markdown` rows, cell by cell: threads, pp, tg and
    TTFT as mean and stddev, the largest run's peak RSS, the plan (edgeinfer's rows), the tg
    ratio to edgeinfer, and with --agreement the top-1 (%) and the greedy prefix."""
    out: list[Src] = []
    for model, engine, prompt in rows:
        r = bench_row(f, model, engine, prompt)
        out += [bare(r("threads"))]
        out += [
            bare(r(name, stat))
            for name in ("pp_tok_s", "tg_tok_s", "ttft_ms")
            for stat in ("mean", "stddev")
        ]
        out.append(bare(r("peak_rss_mb", "max")))
        if engine == "edgeinfer":
            out.append(bare(r("plan_total_mb")))
        out.append(bare(r("ratio_to_edgeinfer", "tg_tok_s")))
        if agreement:
            out += [
                frac_pct(r("agreement", "top1_agreement")),
                bare(r("agreement", "mean_greedy_prefix")),
            ]
    return out


def _rows(models: tuple[str, ...], engines: tuple[str, ...], prompts: tuple[int, ...]) -> list:
    return [(m, e, p) for m in models for p in prompts for e in engines]


_NATIVE_ROWS = [
    *_rows((SMOL,), PEERS, (128, 512)),
    *_rows(("native-keep", "ortgenai-int4-cpu"), ("edgeinfer", "onnxruntime-genai"), (128, 512)),
]
_ONNX = ("onnx-fp32", "onnx-int8", "onnx-int4")
_DEFAULT_128 = [*_rows((SMOL,), PEERS, (128,)), *_rows(_ONNX, OPTIMUM, (128,))]
DEFAULT_ALL_ROWS = [*_rows((SMOL,), PEERS, (128, 512)), *_rows(_ONNX, OPTIMUM, (128, 512))]


def bench_tg(f, model: str, engine: str, prompt: int):
    return bench_row(f, model, engine, prompt)("tg_tok_s", "mean")


def _busy(f, route: str, hogs: int, shown: tuple[str, ...] = ("default", "t1", "t2")) -> list:
    """A busy-machine row: the hogs, the default, threads=1, threads=2 (medians; a setting
    that timed out shows none) and the default over the best explicit setting."""
    s = under(f, "summary", {"route": route, "hogs": hogs})
    cells = [bare(s("median_decode_tok_s", k)) for k in shown]
    return [bare(s("hogs")), *cells, bare(s("default_vs_best"))]


_GGUF_ROWS = [(SMOL, "edgeinfer", p) for p in (128, 512)]
_ONNX_ROWS = [(m, "edgeinfer", p) for m in _ONNX for p in (128, 512)]
PLAN_OVER_PEAK = {  # the plan over the measured peak, per edgeinfer row
    k: [
        (bench_row(DEFAULT, *r)("plan_total_mb") / bench_row(DEFAULT, *r)("peak_rss_mb", "max") - 1)
        * 100
        for r in rows
    ]
    for k, rows in (("gguf", _GGUF_ROWS), ("onnx", _ONNX_ROWS))
}


def _busy_table(rows: list[tuple[object, str, int]]) -> list:
    return [x for f, route, hogs in rows for x in _busy(f, route, hogs)]


def _ratio_range(pairs: list[tuple[object, object]]) -> tuple[object, object]:
    ratios = [a / b for a, b in pairs]
    return lo(each(*ratios)), hi(each(*ratios))


OPTIMUM_TG_RANGE = _ratio_range(
    [
        (bench_tg(DEFAULT, m, "edgeinfer", p), bench_tg(DEFAULT, m, "optimum", p))
        for m in _ONNX
        for p in (128, 512)
    ]
)
OPTIMUM_PEAK_RANGE = _ratio_range(
    [
        (
            bench_row(DEFAULT, m, "edgeinfer", p)("peak_rss_mb", "max"),
            bench_row(DEFAULT, m, "optimum", p)("peak_rss_mb", "max"),
        )
        for m in _ONNX
        for p in (128, 512)
    ]
)
GENAI_OVER_EDGEINFER = [
    bench_row(DEFAULT, m, "onnxruntime-genai", p)("ratio_to_edgeinfer", "tg_tok_s")
    for m in _ONNX
    for p in (128, 512)
]


def _native_ratio(model: str, engine: str, prompt: int):
    return bench_row(NATIVE, model, engine, prompt)("ratio_to_edgeinfer", "tg_tok_s")


BENCH_SPECS: list[Spec] = [
    spec(
        PERF,
        "| smollm2-135m-instruct | edgeinfer | CPUExecutionProvider | 2 | pp128+tg64 |",
        bench_rows(AGREEMENT_RUN, _rows((SMOL,), PEERS, (128,)), agreement=True),
    ),
    spec(
        PERF,
        "Conditions: the machine, the AMD EPYC, was saturated",
        load(AGREEMENT_RUN("machine", "busy", "loadavg", 0)),
        bare(
            AGREEMENT_RUN(
                "agreement", "engines", {"engine": "edgeinfer"}, "decisive_top1_agreement"
            )
        ),
        bare(
            AGREEMENT_RUN(
                "agreement", "engines", {"engine": "edgeinfer"}, "greedy_agreement_beyond_ties"
            )
        ),
        frac_pct(
            AGREEMENT_RUN("agreement", "engines", {"engine": "onnxruntime-genai"}, "top1_agreement")
        ),
        bare(
            AGREEMENT_RUN(
                "agreement", "engines", {"engine": "onnxruntime-genai"}, "decisive_top1_agreement"
            )
        ),
        bare(
            AGREEMENT_RUN(
                "agreement", "engines", {"engine": "onnxruntime-genai"}, "mean_greedy_prefix"
            )
        ),
    ),
    spec(
        PERF,
        "| native-keep | edgeinfer | CPUExecutionProvider | 2 | pp128+tg128 |",
        bench_rows(NATIVE, _NATIVE_ROWS),
    ),
    spec(
        PERF,
        "The native graph decodes level with llama-cpp-python",
        times(
            bench_tg(NATIVE, "native-keep", "edgeinfer", 512)
            / bench_tg(NATIVE, SMOL, "llama-cpp-python", 512)
        ),
        ms(bench_row(NATIVE, SMOL, "llama-cpp-python", 128)("ttft_ms", "mean")),
        times(
            bench_row(NATIVE, "native-keep", "onnxruntime-genai", 512)(
                "ratio_to_edgeinfer", "tg_tok_s"
            )
        ),
        times(
            bench_row(NATIVE, "native-keep", "onnxruntime-genai", 128)(
                "ratio_to_edgeinfer", "tg_tok_s"
            )
        ),
        times(
            1
            / bench_row(NATIVE, "ortgenai-int4-cpu", "onnxruntime-genai", 128)(
                "ratio_to_edgeinfer", "tg_tok_s"
            )
        ),
        times(
            1
            / bench_row(NATIVE, "ortgenai-int4-cpu", "onnxruntime-genai", 512)(
                "ratio_to_edgeinfer", "tg_tok_s"
            )
        ),
        # the per-block offset term: the MatMul and Add nodes beside each MatMulNBits
        bare(
            PROFILE("profile", "MatMul", "ms_per_step") + PROFILE("profile", "Add", "ms_per_step")
        ),
        ms(total(PROFILE("profile", "*", "ms_per_step"))),
        ms(total(PROFILE("also", "profile", "*", "ms_per_step"))),
        ms(
            PROFILE("profile", "MatMulNBits", "ms_per_step")
            - PROFILE("also", "profile", "MatMulNBits", "ms_per_step")
        ),
    ),
    spec(
        PERF,
        "| onnx-fp32 | optimum | CPUExecutionProvider | 2 | pp128+tg128 |",
        bench_rows(DEFAULT, _DEFAULT_128),
    ),
    spec(
        PERF,
        "The onnx-int8 rows are the int8 folder before its scheme changed",
        tps(bench_tg(INT8, "onnx-int8", "edgeinfer", 128)),
        tps(bench_row(INT8, "onnx-int8", "edgeinfer", 128)("pp_tok_s", "mean")),
        mb(bench_row(INT8, "onnx-int8", "edgeinfer", 128)("peak_rss_mb", "max")),
        tps(bench_tg(INT8, "onnx-int8", "optimum", 128)),
        times(bench_row(INT8, "onnx-int8", "optimum", 128)("ratio_to_edgeinfer", "tg_tok_s")),
        mb(bench_row(INT8, "onnx-int8", "optimum", 128)("peak_rss_mb", "max")),
        times(lo(each(*GENAI_OVER_EDGEINFER))),
        times(hi(each(*GENAI_OVER_EDGEINFER))),
    ),
    spec(
        PERF,
        "Decode tok/s of the default model, 128-token prompt, 128 greedy tokens",
        load(IDLE("loadavg_start", 0)),
        load(IDLE("loadavg_end", 0)),
        load(hi(each(HOGS("loadavg_end", 0), HOGS("runs", "*", "loadavg_before", 0)))),
    ),
    spec(
        PERF,
        "| llama.cpp | 0 | 60.11 |",
        _busy_table(
            [
                (IDLE, "llama.cpp", 0),
                (HOGS, "llama.cpp", 1),
                (HOGS, "llama.cpp", 2),
                (IDLE, "onnxruntime", 0),
                (HOGS, "onnxruntime", 1),
                (HOGS, "onnxruntime", 2),
            ]
        ),
    ),
    spec(
        PERF,
        "Beside one busy core the default reached",
        times(HOGS("summary", {"route": "llama.cpp", "hogs": 1}, "default_vs_best")),
        times(HOGS("summary", {"route": "onnxruntime", "hogs": 1}, "default_vs_best")),
        bare(HOGS("summary", {"route": "llama.cpp", "hogs": 1}, "median_decode_tok_s", "t2")),
        tps(HOGS("summary", {"route": "onnxruntime", "hogs": 1}, "median_decode_tok_s", "t2")),
        load(hi(each(HOGS("loadavg_end", 0), HOGS("runs", "*", "loadavg_before", 0)))),
        times(IDLE("summary", {"route": "onnxruntime", "hogs": 0}, "default_vs_best")),
        given("3%", "the issue's allowance"),
    ),
    spec(
        PERF,
        "The same benchmark on a machine saturated by other jobs, earlier",
        load(BUSY("loadavg_start", 0)),
        bare(BUSY("loadavg_end", 0)),
    ),
    spec(
        PERF,
        "| llama.cpp | 0 | 4.14 |",
        _busy(BUSY, "llama.cpp", 0, ("default", "t1")),
        _busy(BUSY, "llama.cpp", 1, ("default", "t1")),
        _busy(BUSY, "llama.cpp", 2, ("default", "t1")),
        _busy(BUSY, "onnxruntime", 0),
        _busy(BUSY, "onnxruntime", 1),
        _busy(BUSY, "onnxruntime", 2),
    ),
    spec(
        PERF,
        "There, on the loaded machine, the default chose one thread",
        times(lo(BUSY("summary", "*", "default_vs_best"))),
    ),
    spec(
        PERF,
        "Another lever, measured but not made the default",
        tps(OMP("summary", 0, "median_decode_tok_s", "t2:OMP_WAIT_POLICY=PASSIVE")),
        tps(OMP("summary", 0, "median_decode_tok_s", "t1")),
        load(OMP("loadavg_start", 0)),
        load(hi(each(OMP("loadavg_end", 0), OMP("runs", "*", "loadavg_before", 0)))),
    ),
    spec(
        PERF,
        "Which route a catalog GGUF takes on a CPU.",
        tps(bench_tg(NATIVE, SMOL, "edgeinfer", 128)),
        tps(bench_tg(NATIVE, "native-keep", "edgeinfer", 128)),
        ms(bench_row(NATIVE, SMOL, "edgeinfer", 128)("ttft_ms", "mean")),
        ms(bench_row(NATIVE, "native-keep", "edgeinfer", 128)("ttft_ms", "mean")),
        mb(bench_row(NATIVE, SMOL, "edgeinfer", 128)("peak_rss_mb", "max")),
        mb(bench_row(NATIVE, "native-keep", "edgeinfer", 128)("peak_rss_mb", "max")),
        frac_pct(AGREE("pairs", "llama.cpp f32 KV vs native ONNX", "top1_agreement")),
        load(AGREE("load_average", "before", 0)),
    ),
    spec(
        PERF,
        "One sequence of a larger K-quant file is another matter.",
        given("1.3x", "the route rule's limit (routes.ONE_SEQUENCE_READS), a setting"),
    ),
    spec(
        PERF,
        "| catalog model | transcode reads ÷ file |",
        *[f for model in READS_MODELS for f in _reads_row(model)],
    ),
    spec(
        PERF,
        "(8 sequences: the steady decode of all eight together.)",
        times(
            ROUTES("summary", f"{READS_MODELS[2]} parallel=1", "llama.cpp", "tg_tok_s")
            / ROUTES("summary", f"{READS_MODELS[2]} parallel=1", "onnxruntime", "tg_tok_s")
        ),
        mb(ROUTES("summary", f"{READS_MODELS[2]} parallel=1", "llama.cpp", "peak_rss_mb")),
        mb(ROUTES("summary", f"{READS_MODELS[2]} parallel=1", "onnxruntime", "peak_rss_mb")),
    ),
    spec(
        PERF,
        "Two sequences part the two files:",
        *[
            f
            for model in READS_MODELS[1:]
            for f in (
                times(ROUTES2("summary", f"{model} parallel=2", "decode_onnx_over_llama")),
                tps(ROUTES2("summary", f"{model} parallel=2", "onnxruntime", "steady_tg_tok_s")),
                tps(ROUTES2("summary", f"{model} parallel=2", "llama.cpp", "steady_tg_tok_s")),
            )
        ],
    ),
]
