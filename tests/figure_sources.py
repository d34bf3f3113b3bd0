"""Where each figure of the READMEs and docs/ comes from (read by tests/test_readme_figures.py).

One ``spec`` per block that holds figures: the page, a piece of the block's text that finds
it, then one entry per figure in the order the block writes them. ``R(...)`` is a field of
the results file bound to ``R``; arithmetic over fields is a derived figure; ``given`` is a
figure that is not a measurement, with its reason. Short pages are here; docs/memory.md and
docs/converting.md are in ``figure_sources_docs.py``, docs/performance.md in
``figure_sources_bench.py`` and benchmarks/README.md in ``figure_sources_readme.py``.
"""

from __future__ import annotations

import json

from tests.figure_sources_bench import BENCH_SPECS
from tests.figure_sources_docs import DOCS_SPECS
from tests.figure_sources_readme import README_SPECS
from tests.figure_values import (
    each,
    hi,
    lo,
    results,
    under,
)
from tests.figures import (
    RESULTS,
    Spec,
    bare,
    frac_pct,
    given,
    load,
    mb_s,
    ms,
    pct,
    sec,
    texts_s,
    times,
    us,
)

A_LIMIT = "an input limit"
CATALOG_SIZE = "the catalog file's size on the package index"
DEFAULT = "a default setting"

CHAT_REUSE = results("chat_reuse.json")
EMBED_QUIET = results("bench-embed-gguf-quiet.json")
EMBED_BUSY = results("bench-embed-gguf.json")
FIRST = results("first_answer_onnx.json")
CACHE = results("prompt_cache.json")
SAMPLING = results("sampling.json")
SERVE = results("serve.json")
STRUCT = results("structured.json")
TOOL_CALLS = results("tool_calls.json")
_TOOL_RATES = ("called_when_should", "right_function", "arguments_valid", "arguments_right",
               "no_call_when_none_fits", "final_answer_clean")  # fmt: skip


def _tool_rows() -> list:  # type: ignore[type-arg]
    """docs/tools.md's table: each model and setting, each rate that has a denominator."""
    data = json.loads((RESULTS / "tool_calls.json").read_text())
    cells = []
    for model, by in data["summary"].items():
        for setting, rates in by.items():
            for key in _TOOL_RATES:
                if rates[key]["rate"] is not None:
                    cells.append(frac_pct(TOOL_CALLS("summary", model, setting, key, "rate")))
    return cells


_CACHE = {r: under(CACHE, "summary", r) for r in ("onnx", "gguf")}


def _cache_row(route: str) -> list:  # type: ignore[type-arg]
    c = _CACHE[route]
    row = [
        sec(c("ttft_cold_s")),
        sec(c("ttft_warm_s")),
        times(c("warm_over_cold")),
        given("0.15x", "a target"),
        load(CACHE("loadavg_start", 0)),
        bare(c("snapshot_over_kv")),
        bare(c("snapshot_bytes")),
    ]
    if route == "onnx":
        row.append(bare(c("snapshot_tokens")))
    return [*row, mb_s(c("restore_mb_s")), mb_s(c("read_mb_s"))]


SMALL_SPECS = [
    Spec(
        "README.md",
        "Both start from a clone of this repository",
        (given("3.10", "a Python version"),),
    ),
    Spec("README.md", "**1. Set up and stream an answer**", (given("98 MB", CATALOG_SIZE),)),
    Spec(
        "docs/index.md",
        "The project's README gives these two commands",
        (given("3.10", "a Python version"),),
    ),
    Spec(
        "docs/index.md",
        "Set up and stream an answer from the default model",
        (given("98 MB", CATALOG_SIZE),),
    ),
    Spec("docs/index.md", "| name | format | source |", (given("98 MB", CATALOG_SIZE),)),
    Spec(
        "docs/index.md",
        "`.[onnx]` installs wheels only",
        (
            load(FIRST("loadavg_start", 0)),
            sec(FIRST("first_answer_s")),
            sec(FIRST("steps", "venv", "total_s")),
            sec(FIRST("install_s")),
            sec(FIRST("steps", "run", "first_output_s")),
        ),
    ),
    Spec(
        "docs/generation.md",
        "- Sampling keywords: `max_new_tokens` (256)",
        (
            given("0.8", DEFAULT),
            given("0.95", DEFAULT),
            pct(hi(SAMPLING("rows", "*", "share_of_decode")) * 100),  # the costliest row, 1.7%
        ),
    ),
    Spec(
        "docs/generation.md",
        "- Prompt reuse: the model keeps the token ids",
        (
            times(CHAT_REUSE("ratio")),
            load(
                lo(
                    each(
                        CHAT_REUSE("runs", "*", "loadavg_before", 0),
                        CHAT_REUSE("runs", "*", "loadavg_after", 0),
                    )
                )
            ),
            load(
                hi(
                    each(
                        CHAT_REUSE("runs", "*", "loadavg_before", 0),
                        CHAT_REUSE("runs", "*", "loadavg_after", 0),
                    )
                )
            ),
        ),
    ),
    Spec(
        "docs/serving.md",
        "- Sampling fields a request leaves out",
        (given("0.8", DEFAULT), given("0.95", DEFAULT)),
    ),
    Spec(
        "docs/serving.md",
        "What the server adds per streamed token",
        (
            ms(SERVE("added_ms_per_token")),
            ms(SERVE("api_median_ms")),
            frac_pct(SERVE("added_fraction")),
            ms(lo(SERVE("api_step_ms"))),
            ms(hi(SERVE("api_step_ms"))),
            ms(lo(SERVE("server_step_ms"))),
            ms(hi(SERVE("server_step_ms"))),
        ),
    ),
    Spec(
        "docs/structured-output.md",
        "- An invalid schema, pattern or grammar raises",
        (
            given("8 MiB", "the size of a hostile input that was tried"),
            given("64 KiB", A_LIMIT),
            given("8 KiB", A_LIMIT),
            given("64 KiB", A_LIMIT),
            given("256 MiB", "a setting (stack)"),
        ),
    ),
    Spec(
        "docs/structured-output.md",
        "Measured on the default model, 2 threads",
        (
            times(STRUCT("ratio")),
            ms(STRUCT("llguidance", "compile_ms")),
            us(STRUCT("llguidance", "mask_us_median")),
            us(STRUCT("outlines_core", "mask_us_median")),
            sec(STRUCT("outlines_core", "build_ms") / 1000),
        ),
    ),
    Spec(
        "docs/strangers.md", "- **GGUF headers** are parsed defensively", (given("1 MiB", A_LIMIT),)
    ),
    Spec(
        "docs/strangers.md",
        "- **Chat templates** run in Jinja2's",
        (
            given("2 s", "a limit (RENDER_DEADLINE_S)"),
            given("16x", "a limit"),
        ),
    ),
    Spec(
        "docs/tools.md",
        "- `tools`, `tool_choice` and `parallel_tool_calls`",
        (given("512 KiB", A_LIMIT),),
    ),
    Spec(
        "docs/tools.md",
        "Use **`qwen2.5-coder-1.5b-instruct`** for tools.",
        (
            load(TOOL_CALLS("conditions", "load_before", 0)),
            bare(TOOL_CALLS("conditions", "load_after", 0)),
        ),
    ),
    Spec("docs/tools.md", "| model | `auto` | called when it should |", tuple(_tool_rows())),
    Spec(
        "docs/apps.md",
        "`apps/device_service.py` is a headless service",
        (
            given("1 MiB", A_LIMIT),
            given("75%", "a setting"),
            given("512 MiB", "a setting"),
        ),
    ),
    Spec("docs/batch.md", "- Input from strangers is bounded", (given("1 MiB", A_LIMIT),)),
    Spec(
        "docs/embeddings.md",
        "On the same weights, in the same run, the GGUF route",
        (given("0.999", "the test's threshold"),),
    ),
    Spec(
        "docs/embeddings.md",
        "Speed, 256 tickets, batch 32, 2 threads",
        (
            load(EMBED_QUIET("load_average", "before", 0)),
            texts_s(EMBED_QUIET("rows", 0, "texts_per_s_median")),
            texts_s(EMBED_QUIET("rows", 1, "texts_per_s_median")),
            times(
                EMBED_QUIET("rows", 1, "texts_per_s_median")
                / EMBED_QUIET("rows", 0, "texts_per_s_median")
            ),
            bare(EMBED_QUIET("rows", 1, "min_cosine_to_reference")),
            load(
                lo(each(EMBED_BUSY("load_average", "before"), EMBED_BUSY("load_average", "after")))
            ),
            load(
                hi(each(EMBED_BUSY("load_average", "before"), EMBED_BUSY("load_average", "after")))
            ),
            bare(EMBED_BUSY("rows", 0, "texts_per_s_median")),
            texts_s(EMBED_BUSY("rows", 1, "texts_per_s_median")),
        ),
    ),
    Spec(
        "docs/warm-starts.md",
        "- **Automatic.** `load(..., prompt_cache=DIR)`",
        (given("2 GiB", DEFAULT),),
    ),
    Spec(
        "docs/warm-starts.md",
        "Measured (`python benchmarks/prompt_cache.py --rounds 3`",
        (load(CACHE("loadavg_start", 0)),),
    ),
    Spec(
        "docs/warm-starts.md",
        "| route | TTFT without → with the snapshot |",
        (
            *_cache_row("onnx"),
            *_cache_row("gguf"),
        ),
    ),
    Spec(
        "docs/warm-starts.md",
        "The first request's TTFT while its snapshot is written",
        (
            given("1.05x", "a target"),
            times(_CACHE["onnx"]("write_over_cold")),
            sec(_CACHE["onnx"]("ttft_first_request_writing_s")),
            sec(_CACHE["onnx"]("ttft_first_request_no_cache_s")),
            times(_CACHE["gguf"]("write_over_cold")),
            sec(_CACHE["gguf"]("ttft_first_request_writing_s")),
            sec(_CACHE["gguf"]("ttft_first_request_no_cache_s")),
            load(CACHE("loadavg_start", 0)),
            sec(_CACHE["onnx"]("ttft_first_request_no_cache_s")),
            sec(_CACHE["onnx"]("ttft_cold_s")),
        ),
    ),
]

SPECS: list[Spec] = [*SMALL_SPECS, *DOCS_SPECS, *BENCH_SPECS, *README_SPECS]
