"""Where the figures of benchmarks/README.md come from (see figure_sources)."""

from __future__ import annotations

from tests.figure_sources_bench import (
    DEFAULT,
    DEFAULT_ALL_ROWS,
    GENAI_OVER_EDGEINFER,
    INT8,
    OPTIMUM_PEAK_RANGE,
    OPTIMUM_TG_RANGE,
    PLAN_OVER_PEAK,
    SMOL,
    bench_row,
    bench_rows,
    bench_tg,
)
from tests.figure_values import (
    each,
    hi,
    lo,
    matched,
    results,
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
    pct,
    spec,
    texts_s,
    times,
    tps,
)

BENCH = "benchmarks/README.md"
EMB = {"quiet": results("embeddings.json"), "busier": results("embeddings-busier.json")}
EMBED_QUIET = results("bench-embed-gguf-quiet.json")
EMBED_BUSY = results("bench-embed-gguf.json")
SERVE = results("serve.json")
STRUCT = results("structured.json")
MEM_GGUF = results("memory-gguf.json")
MEM_INT8 = results("memory-onnx-int8.json")
GRID = results("memory-grid-gguf.json")
PARTS = results("memory-parts-gguf.json")
ONNX_MEM = results("onnx_memory.json")
SESSIONS = results("onnx_memory_sessions.json")
SAMPLING = results("sampling.json")
REUSE = results("chat_reuse.json")
REUSE_FP32 = results("chat_reuse_onnx_fp32.json")


def _emb_row(which: str) -> list:
    s = under(EMB[which], "summary")
    out = [bare(s("texts_per_s_median", e)) for e in ("edgeinfer", "st-torch", "st-onnx")]
    for peer in ("st-torch", "st-onnx"):
        out.append(times(s("edgeinfer_vs", peer)))
        out += [bare(s("edgeinfer_vs_per_round", peer, i)) for i in range(4)]
    return out


def _loads(f, before: str, after: str):
    """Every load figure a file records at its start and end (1, 5 and 15 minutes)."""
    return each(f(*before.split("/")), f(*after.split("/")))


def _grid_row(i: int) -> list:
    c = under(GRID, "cases", i)
    return [bare(c("planned") / 1e6), bare(c("peak_rss") / 1e6)]


def _sampling_row(i: int) -> list:
    r = under(SAMPLING, "rows", i)
    return [bare(r("median_us")), frac_pct(r("share_of_decode"))]


def _reuse_loads():
    return each(REUSE("runs", "*", "loadavg_before", 0), REUSE("runs", "*", "loadavg_after", 0))


_PARTS = (
    "python",
    "import edgeinfer (numpy, psutil)",
    "llama.cpp engine",
    "model loaded (context 256)",
)
_SESSION = under(SESSIONS, "session_summary_mb")
_TOK = "texts_per_s_median"


def _tg_ratio(model: str, engine: str, prompt: int):
    """A bench-default.json row's decode rate over edgeinfer's in the same configuration."""
    return bench_row(DEFAULT, model, engine, prompt)("ratio_to_edgeinfer", "tg_tok_s")


README_SPECS: list[Spec] = [
    spec(
        BENCH,
        "Two runs of 4 rounds, 2 shared cores",
        *(
            load(fn(_loads(EMB[w], "machine/load_average_before", "machine/load_average_after")))
            for w in ("quiet", "busier")
            for fn in (lo, hi)
        ),
    ),
    spec(BENCH, "| `embeddings.json` | 117.8 |", _emb_row("quiet"), _emb_row("busier")),
    spec(
        BENCH,
        "Lowest cosine to sentence-transformers (torch)",
        bare(EMB["quiet"]("summary", "edgeinfer_min_cosine")),
    ),
    spec(
        BENCH,
        "Read with care: the machine was shared",
        texts_s(EMB["quiet"]("summary", "texts_per_s_median", "st-torch")),
        times(EMB["quiet"]("summary", "targets", "st-torch")),
        times(EMB["quiet"]("summary", "targets", "st-onnx")),
    ),
    spec(
        BENCH,
        "The GGUF route (the same weights as a float32 BERT GGUF",
        texts_s(EMBED_QUIET("rows", 0, _TOK)),
        bare(EMBED_QUIET("rows", 1, _TOK)),
        bare(EMBED_BUSY("rows", 0, _TOK)),
        bare(EMBED_BUSY("rows", 1, _TOK)),
        bare(EMBED_QUIET("rows", 1, "min_cosine_to_reference")),
    ),
    spec(
        BENCH,
        "`python benchmarks/bench_serve.py` starts `edgeinfer serve`",
        ms(SERVE("api_median_ms")),
        ms(SERVE("server_median_ms")),
        ms(SERVE("added_ms_per_token")),
        frac_pct(SERVE("added_fraction")),
        ms(lo(SERVE("api_step_ms"))),
        ms(hi(SERVE("api_step_ms"))),
    ),
    spec(
        BENCH,
        "`python benchmarks/bench_structured.py` runs the same chat request",
        times(STRUCT("ratio")),
        ms(STRUCT("llguidance", "compile_ms")),
        Src(STRUCT("llguidance", "mask_us_median"), "\u00b5s"),
        Src(STRUCT("outlines_core", "build_ms") / 1000, "s"),
        Src(STRUCT("outlines_core", "mask_us_median"), "\u00b5s"),
    ),
    spec(
        BENCH,
        "| smollm2-135m-instruct | edgeinfer | llama.cpp:CPU | 2 | pp512+tg128 | 293.0",
        bench_rows(DEFAULT, DEFAULT_ALL_ROWS),
    ),
    spec(
        BENCH,
        "The onnx-int8 rows above are the int8 folder",
        tps(bench_tg(INT8, "onnx-int8", "edgeinfer", 128)),
        mb(bench_row(INT8, "onnx-int8", "edgeinfer", 128)("peak_rss_mb", "max")),
        times(bench_row(INT8, "onnx-int8", "optimum", 128)("ratio_to_edgeinfer", "tg_tok_s")),
    ),
    spec(
        BENCH,
        "- **GGUF**: edgeinfer's loop over llama.cpp",
        times(1 / _tg_ratio(SMOL, "llama-cpp-python", 128)),
        times(1 / _tg_ratio(SMOL, "llama-cpp-python", 512)),
    ),
    spec(
        BENCH,
        "- **onnxruntime-genai**'s int4 graph",
        times(_tg_ratio(SMOL, "onnxruntime-genai", 128)),
        times(_tg_ratio(SMOL, "onnxruntime-genai", 512)),
        mb(bench_row(DEFAULT, SMOL, "onnxruntime-genai", 128)("peak_rss_mb", "max")),
        mb(bench_row(DEFAULT, SMOL, "onnxruntime-genai", 512)("peak_rss_mb", "max")),
        mb(bench_row(DEFAULT, SMOL, "edgeinfer", 128)("peak_rss_mb", "max")),
        mb(bench_row(DEFAULT, SMOL, "edgeinfer", 512)("peak_rss_mb", "max")),
    ),
    spec(
        BENCH,
        "- **edgeinfer's ONNX folders**",
        times(OPTIMUM_TG_RANGE[0]),
        times(OPTIMUM_TG_RANGE[1]),
        times(OPTIMUM_PEAK_RANGE[0]),
        times(OPTIMUM_PEAK_RANGE[1]),
        times(lo(each(*GENAI_OVER_EDGEINFER))),
        times(hi(each(*GENAI_OVER_EDGEINFER))),
    ),
    spec(
        BENCH,
        "- The memory plan is above every measured peak",
        pct(lo(each(*PLAN_OVER_PEAK["gguf"]))),
        pct(hi(each(*PLAN_OVER_PEAK["gguf"]))),
        pct(lo(each(*PLAN_OVER_PEAK["onnx"]))),
        pct(hi(each(*PLAN_OVER_PEAK["onnx"]))),
    ),
    spec(
        BENCH,
        "`python benchmarks/bench_memory.py --budgets 200MB 256MB 512MB --out",
        given("95%", "a setting (--fill)"),
        frac_pct(lo(MEM_GGUF("cases", "*", "error_vs_peak"))),
        frac_pct(hi(MEM_GGUF("cases", "*", "error_vs_peak"))),
        frac_pct(lo(each(*(MEM_INT8("cases", i, "error_vs_peak") for i in (1, 2, 3))))),
        frac_pct(hi(each(*(MEM_INT8("cases", i, "error_vs_peak") for i in (1, 2, 3))))),
        mb(matched(MEM_INT8("cases", 0, "budget"), r"(\d+)MB")),
    ),
    spec(
        BENCH,
        "`python benchmarks/bench_memory.py --grid`",
        given("8192x", "a setting: contexts by prefill batches"),
        *(x for i in range(6) for x in _grid_row(i)),
        frac_pct(lo(GRID("cases", "*", "error_vs_peak"))),
        frac_pct(hi(GRID("cases", "*", "error_vs_peak"))),
        *(Src(PARTS("added_mib", k), "MiB") for k in _PARTS),
        load(PARTS("load_average", 0)),
    ),
    spec(
        BENCH,
        "| 2048 | 328.7 MB |",
        *(
            x
            for c in ("2048", "8192")
            for x in (
                mb(ONNX_MEM("summary_mb", c, "onnx-native", "peak_rss")),
                mb(ONNX_MEM("summary_mb", c, "llama-cpp-python", "peak_rss")),
                bare(ONNX_MEM("summary_mb", c, "native_peak_over_llama_cpp_python")),
                mb(ONNX_MEM("summary_mb", c, "onnx-native", "planned")),
            )
        ),
    ),
    spec(
        BENCH,
        "What the native route holds (same file",
        given("1.32", "a version"),
        load(hi(each(ONNX_MEM("load_average_start", 0), SESSIONS("load_average_start", 0)))),
    ),
    spec(
        BENCH,
        "- **Weights, pre-packed.**",
        mb(_SESSION("default", "session_rss")),
        mb(_SESSION("default", "session_peak_rss")),
        mb(
            ONNX_MEM(
                "runs",
                {"engine": "onnx-native", "context": 2048},
                "resident_mb_at_end",
                "model.onnx.data",
            )
        ),
    ),
    spec(
        BENCH,
        "- **No option holds fewer.**",
        mb(_SESSION("no-prepacking", "session_rss")),
        bare(_SESSION("no-prepacking", "decode_tok_s")),
        tps(_SESSION("default", "decode_tok_s")),
        mb(_SESSION("no-prepacking", "peak_rss")),
        mb(_SESSION("prepacked-in-file", "session_rss")),
        mb(_SESSION("prepacked-in-file", "session_peak_rss")),
        mb(_SESSION("no-constant-folding", "session_rss")),
        mb(_SESSION("no-constant-folding", "peak_rss")),
    ),
    spec(
        BENCH,
        "- **The KV cache is touched in full.**",
        mb(
            ONNX_MEM(
                "runs", {"engine": "onnx-native", "context": 8192}, "resident_mb_at_end", "anon"
            )
        ),
        mb(
            ONNX_MEM(
                "runs", {"engine": "onnx-native", "context": 2048}, "resident_mb_at_end", "anon"
            )
        ),
        given("1.32", "a version"),
    ),
    spec(
        BENCH,
        "`python benchmarks/bench_sampling.py --threads 2`: the sampler alone",
        ms(SAMPLING("decode_step_us") / 1000),
    ),
    spec(BENCH, "| greedy | 5 | 0.1% |", *(x for i in range(7) for x in _sampling_row(i))),
    spec(
        BENCH,
        "`python benchmarks/bench_chat_reuse.py --runs 3`: a system prompt",
        load(lo(_reuse_loads())),
        load(hi(_reuse_loads())),
    ),
    spec(
        BENCH,
        "| model | turn-4 prompt | reused | TTFT reused |",
        bare(REUSE("runs", 0, "prompt_tokens")),
        bare(REUSE("runs", 0, "reused_prompt_tokens")),
        ms(REUSE("ttft_reused_median_s") * 1000),
        ms(REUSE("ttft_fresh_median_s") * 1000),
        frac_pct(REUSE("ratio")),
        bare(REUSE_FP32("runs", 0, "prompt_tokens")),
        bare(REUSE_FP32("runs", 0, "reused_prompt_tokens")),
        ms(REUSE_FP32("runs", 0, "ttft_reused_s") * 1000),
        ms(REUSE_FP32("runs", 0, "ttft_fresh_s") * 1000),
        frac_pct(REUSE_FP32("ratio")),
    ),
]
