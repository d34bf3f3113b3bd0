"""Many streams with speculative decoding on and off: what drafting costs a full batch.

A sequence drafts only while it runs alone; beside other streams it steps aside into the
batched step. This runs ``edgeinfer bench --parallel N`` (N concurrent streams, aggregate
decode tokens/s) with each ``--speculative`` setting, interleaved round by round, each run a
fresh process, and reports each setting's median aggregate and its ratio to ``off``.

    python benchmarks/parallel_speculative.py --parallel 8 --settings off,auto,lookup \\
        --rounds 3 --threads 2 -o benchmarks/results/parallel_speculative.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions
from bench_cli import edgeinfer_runs


def bench_once(setting: str, args: argparse.Namespace) -> float:
    """One ``edgeinfer bench --parallel N`` run with ``setting``: aggregate decode tok/s."""
    options = [
        args.model, "--parallel", str(args.parallel), "--speculative", setting,
        "-p", str(args.prompt_tokens), "-n", str(args.new_tokens), "-r", "1", "--warmup", "1",
        "--threads", str(args.threads),
    ]  # fmt: skip
    runs = edgeinfer_runs(options, timeout=args.timeout)
    return statistics.median(float(r["decode_tok_s"]) for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--settings", default="off,auto,lookup")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=128)
    parser.add_argument("-n", "--new-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("-o", "--out", type=Path, default=Path("parallel_speculative.json"))
    args = parser.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    if "off" not in settings:
        parser.error("--settings must include off (the reference)")
    cond = conditions.start(args.threads, args.rounds)
    runs: list[dict[str, Any]] = []
    for n in range(args.rounds):
        for setting in settings:
            rate = bench_once(setting, args)
            runs.append({"round": n, "setting": setting, "aggregate_decode_tok_s": rate})
            print(f"round {n} {setting}: {rate:.1f} tok/s", file=sys.stderr)
    summary: dict[str, Any] = {}
    for setting in settings:
        rates = [r["aggregate_decode_tok_s"] for r in runs if r["setting"] == setting]
        ratios = [
            r["aggregate_decode_tok_s"] / o["aggregate_decode_tok_s"]
            for r in runs if r["setting"] == setting
            for o in runs if o["setting"] == "off" and o["round"] == r["round"]
        ]  # fmt: skip
        summary[setting] = {
            "aggregate_decode_tok_s_median": statistics.median(rates),
            "ratio_to_off_median": statistics.median(ratios),
            "ratio_to_off_range": [min(ratios), max(ratios)],
        }
    result = {
        "conditions": conditions.finish(cond),
        "model": args.model,
        "workload": {
            "parallel": args.parallel,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
        },
        "summary": summary,
        "runs": runs,
    }
    conditions.write(args.out, result)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
