"""Which engine a catalog GGUF should run on, one sequence and several: each model's exact
ONNX transcode against llama.cpp on the file itself, beside how many bytes a step of the
transcode reads over the file's (``transcode_reads``, what the route rule weighs).

For each model and each ``--parallel`` value, rounds of ``edgeinfer bench MODEL --engine E``
(a fresh process per run, the same prompt token ids, greedy, the end-of-generation tokens
banned) with the two engines in turn, A B then B A: decode and prefill tokens/s, time to
first token, peak RSS; at ``--parallel N > 1`` the steady aggregate decode of N streams.
Reported per model and setting: the medians over the rounds and transcode ÷ llama.cpp.

    python benchmarks/route_reads.py --rounds 2 --parallel 1,8 \
        -o benchmarks/results/route_reads.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_parallel
import conditions

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
ENGINES = ("onnxruntime", "llama.cpp")
FIGURES = ("tg_tok_s", "pp_tok_s", "ttft_ms", "peak_rss_mb", "steady_tg_tok_s")


def reads(model: str) -> dict[str, Any]:
    """The transcode's read ratio and the route ``load()`` takes, one sequence and eight."""
    from edgeinfer.converters.onnx.builder.gguf_blocks import transcode_reads
    from edgeinfer.files.source import resolve
    from edgeinfer.load_plan import route_for

    source = resolve(model)
    return {
        "transcode_reads": round(transcode_reads(source.header.tensors), 4),
        "route_one_sequence": route_for(model, source, "auto").to_dict(),
        "route_parallel_8": route_for(model, source, "auto", parallel=8).to_dict(),
    }


def bench(model: str, engine: str, parallel: int, args: argparse.Namespace) -> dict[str, Any]:
    """One ``edgeinfer bench`` run (its warm-up run, then one measured): the figures."""
    options = [model, "--engine", engine, "-p", str(args.prompt_tokens),
               "-n", str(args.new_tokens), "-r", "1", "--threads", str(args.threads),
               "--timeout", str(args.run_timeout)]  # fmt: skip
    if parallel > 1:
        options += ["--parallel", str(parallel)]
    row = bench_parallel.bench(options)["results"][0]
    figures = {}
    for name in FIGURES:
        value = row.get(name)
        if isinstance(value, dict):
            value = value.get("median")
        if value is not None:
            figures[name] = round(float(value), 2)
    return figures


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per model, setting and engine, and the transcode over llama.cpp."""
    table: dict[str, Any] = {}
    for key in sorted({(r["model"], r["parallel"]) for r in runs}):
        cell: dict[str, Any] = {}
        for engine in ENGINES:
            mine = [r["figures"] for r in runs if (r["model"], r["parallel"]) == key
                    and r["engine"] == engine]  # fmt: skip
            cell[engine] = {name: statistics.median(f[name] for f in mine)
                            for name in FIGURES if all(name in f for f in mine)}  # fmt: skip
        ratio_of = "tg_tok_s" if key[1] == 1 else "steady_tg_tok_s"
        onnx, llama = cell["onnxruntime"].get(ratio_of), cell["llama.cpp"].get(ratio_of)
        if onnx and llama:
            cell["decode_onnx_over_llama"] = round(onnx / llama, 3)
        table[f"{key[0]} parallel={key[1]}"] = cell
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--parallel", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--run-timeout", type=float, default=900, help="edgeinfer bench --timeout")
    p.add_argument("-o", "--out", type=Path, default=Path("benchmarks/results/route_reads.json"))
    args = p.parse_args()
    models = args.models.split(",")
    settings = [int(n) for n in args.parallel.split(",")]
    found = {m: reads(m) for m in models}
    cond = conditions.start(args.threads, args.rounds)
    runs = []
    for r in range(args.rounds):
        order = ENGINES if r % 2 == 0 else ENGINES[::-1]
        for model in models:
            for parallel in settings:
                for engine in order:
                    figures = bench(model, engine, parallel, args)
                    runs.append({"round": r, "model": model, "parallel": parallel,
                                 "engine": engine, "figures": figures})  # fmt: skip
                    print(f"round {r + 1}: {model} parallel={parallel} {engine}: {figures}",
                          flush=True)  # fmt: skip
    record = {
        "what": "catalog GGUFs on their exact ONNX transcode and on llama.cpp, one sequence "
        "and several, beside the bytes a transcode step reads over the file's",
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "parallel": settings,
            "threads": args.threads,
        },
        "reads": found,
        "summary": summarize(runs),
        "runs": runs,
        "conditions": conditions.finish(cond),
    }
    conditions.write(args.out, record)
    print(json.dumps(record["summary"], indent=1))


if __name__ == "__main__":
    main()
