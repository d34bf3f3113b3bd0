"""The memory plan against the process's measured peak resident set (VmHWM).

Each case runs in a fresh Python process: load the model under a memory budget (or with a
fixed context), fill the planned context to ~95% with a prompt, generate to the end of the
context, then report the plan (context, batch, total and its parts) and the peak RSS.

    python benchmarks/bench_memory.py                      # default GGUF model, budgets
    python benchmarks/bench_memory.py --grid               # contexts x batches (calibration)
    python benchmarks/bench_memory.py --parts              # RSS after each import/load step
    python benchmarks/bench_memory.py --model DIR --budgets 400MB 512MB 1GB
    python benchmarks/bench_memory.py --threads 1 2 4      # each budget at 1, 2, 4 threads
    python benchmarks/bench_memory.py --contexts 256 512   # fixed contexts, no budget
    python benchmarks/bench_memory.py --engine llama.cpp   # load(engine=...) in every case

A budget the plan refuses is a row with its error (the refusal's message) and, with
``--contexts``, the peak a fixed context reaches shows how close it came.

Linux only (VmHWM). Writes benchmarks/results/memory.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import conditions

CHILD = r"""
import json, sys
import edgeinfer
from edgeinfer.memory.rss import peak_rss
model, budget, ctx, batch = sys.argv[1:5]
fill, threads, engine = float(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
kw = {} if engine == "-" else {"engine": engine}
if budget != "-":
    kw["memory_budget"] = budget
if ctx != "-":
    kw["context_length"] = int(ctx)
if batch != "-":  # calibration only: force the prefill batch through the plan's result
    import edgeinfer.memory.plan as m
    m._BATCHES = (int(batch),)
with edgeinfer.load(model, threads=threads, **kw) as llm:
    plan = llm.info["memory_plan"]
    n_ctx = llm.context_length
    unit = llm.tokenize("The quick brown fox jumps over the lazy dog. ")
    ids = (unit * (n_ctx // len(unit) + 1))[: int(n_ctx * fill)]
    result = llm.generate(ids, max_new_tokens=n_ctx - len(ids), temperature=0,
                          logit_bias={t: -100.0 for t in [0, 1, 2]})
    route = {"backend": llm.info.get("backend"), "route": llm.info.get("route")}
    print(json.dumps({"plan": plan, "context_length": n_ctx, "prompt_tokens": len(ids),
                      "route": route,
                      "completion_tokens": result.stats.completion_tokens,
                      "finish_reason": result.finish_reason, "peak_rss": peak_rss()}))
"""


PARTS = r"""
import json, sys
from pathlib import Path
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
steps = {"python": rss()}
import edgeinfer
from edgeinfer.loader import resolve
from edgeinfer.memory.rss import peak_rss
steps["import edgeinfer (numpy, psutil)"] = rss()
source = resolve(sys.argv[1])
if source.format == "gguf":
    import edgeinfer.runtimes.llama_cpp as backend
    backend.engine()
    steps["llama.cpp engine"] = rss()
else:
    import onnxruntime, tokenizers
    steps["onnxruntime + tokenizers"] = rss()
    tokenizers.Tokenizer.from_file(str(source.path / source.header.tokenizer_file))
    steps["tokenizer.json loaded"] = rss()
model = edgeinfer.load(sys.argv[1], context_length=256, threads=2)
steps["model loaded (context 256)"] = rss()
print(json.dumps({"steps": steps, "plan": model.info["memory_plan"], "peak": peak_rss()}))
"""


def parts(model: str, out_path: Path | None) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PARTS, model], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    out = json.loads(done.stdout.strip().splitlines()[-1])
    previous = 0
    for step, value in out["steps"].items():
        print(f"{step:<36} RSS {value / 2**20:7.1f} MiB  (+{(value - previous) / 2**20:6.1f})")
        previous = value
    plan = out["plan"]
    terms = ("process", "weights", "engine", "kv_cache", "compute", "headroom", "total")
    print("plan at context 256: " + ", ".join(f"{t} {plan[t] / 2**20:.1f} MiB" for t in terms))
    print(f"peak RSS after loading: {out['peak'] / 2**20:.1f} MiB")
    if out_path is not None:
        values = list(out["steps"].values())
        added = [round((v - p) / 2**20, 1) for v, p in zip(values, [0, *values], strict=False)]
        record = {"model": model, "added_mib": dict(zip(out["steps"], added, strict=True))}
        record["load_average"] = list(os.getloadavg())
        out_path.write_text(json.dumps({**record, **out}, indent=1) + "\n")
    return 0


def run_case(
    model: str, budget: str, ctx: str, batch: str, fill: float, threads: int, engine: str = "-"
) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, budget, ctx, batch, str(fill), str(threads), engine],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"budget": budget, "context": ctx, "threads": threads, "error": last}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    plan = out["plan"]
    out.update(
        budget=budget,
        threads=threads,
        planned=plan["total"],
        error_vs_peak=(plan["total"] - out["peak_rss"]) / out["peak_rss"],
        within_budget=out["peak_rss"] <= plan["budget"],
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--budgets", nargs="*", default=["200MB", "256MB", "512MB", "1GB"])
    ap.add_argument("--grid", action="store_true", help="contexts x batches, no budget")
    ap.add_argument("--contexts", type=int, nargs="*", default=[], help="fixed, no budget")
    ap.add_argument("--engine", default="-", help="load(engine=...) for every case")
    ap.add_argument("--parts", action="store_true", help="RSS after each import and load step")
    ap.add_argument("--fill", type=float, default=0.95, help="prompt share of the context")
    ap.add_argument("--threads", type=int, nargs="*", default=[2], help="compute threads")
    ap.add_argument("--out", type=Path, default=None, help="default: results/memory.json")
    args = ap.parse_args()
    if args.parts:
        return parts(args.model, args.out)
    args.out = args.out or Path(__file__).parent / "results" / "memory.json"
    cases: list[tuple[str, str, str]] = []
    if args.grid:
        cases = [("-", str(c), str(b)) for c in (512, 2048, 8192) for b in (64, 512)]
    else:
        cases = [(b, "-", "-") for b in args.budgets]
        cases += [("-", str(c), "-") for c in args.contexts]
    rounds = len(cases) * len(args.threads)
    measured = conditions.start(args.threads[0] if len(args.threads) == 1 else None, rounds)
    rows = []
    print(
        f"{'budget':>8} {'thr':>3} {'ctx':>6} {'batch':>5} {'at load MB':>10} {'planned MB':>10} "
        f"{'peak MB':>8} {'plan-peak':>9}"
    )
    for budget, ctx, batch in cases:
        for threads in args.threads:
            row = run_case(args.model, budget, ctx, batch, args.fill, threads, args.engine)
            rows.append(row)
            _print_row(row)
    if rows and all("error" not in r for r in rows):
        slack = [r["planned"] - r["peak_rss"] for r in rows]
        print(f"plan - peak: min {min(slack) / 1e6:+.1f} MB, max {max(slack) / 1e6:+.1f} MB")
    record = {"model": args.model, "cases": rows, "conditions": conditions.finish(measured)}
    conditions.write(args.out, record)
    return 0


def _print_row(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['budget']:>8} {row['threads']:>3} {row['context']:>6} {row['error']}")
        return
    plan = row["plan"]
    loaded = plan.get("loaded")
    print(
        f"{row['budget']:>8} {row['threads']:>3} {row['context_length']:>6} "
        f"{plan['batch_size']:>5} {(loaded or 0) / 1e6:>10.1f} {row['planned'] / 1e6:>10.1f} "
        f"{row['peak_rss'] / 1e6:>8.1f} {row['error_vs_peak']:>+9.1%}"
        + ("" if row["within_budget"] else "  OVER BUDGET")
    )


if __name__ == "__main__":
    sys.exit(main())
