"""The first burst after a fresh start against the later ones: no cold shapes.

Each round starts two fresh processes per context, each loading the default model with
``parallel=N``:

1. bursts: with nothing run before it, ``--bursts`` bursts of N requests at once
   (``generate_many``), each request a prompt of its own that no earlier burst read, so
   every burst reads its prompts (no cached prefix) and meets the shapes a slot engine
   meets: prompt chunks beside decode rows, 1 to N rows;
2. one request: with nothing run before it, one request alone (its time to first token:
   the first request after a start), then three more of the same length (a later one's).

A burst's rate is its completion tokens over its wall time, prompts included. The figures
are the median first burst over the median of the later bursts, and the median first
request's time to first token over the later ones'; at 1.0 a start costs nothing. Rounds
alternate the contexts.

    python benchmarks/first_burst.py [--contexts 512,2048] [--parallel 8] [--rounds 3]
        [--threads 2] [-o benchmarks/results/first_burst.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import conditions

RESULTS = Path(__file__).parent / "results" / "first_burst.json"

_RUN = r"""
import json, statistics, sys, time
import numpy as np
import edgeinfer

kind = sys.argv[1]
parallel, context, prompt, new, threads, bursts = map(int, sys.argv[2:8])
rng = np.random.default_rng(int(sys.argv[8]))

def fresh(n):
    return [[int(t) for t in rng.integers(100, 40000, prompt)] for _ in range(n)]

t0 = time.perf_counter()
with edgeinfer.load("smollm2-135m-instruct", threads=threads, parallel=parallel,
                    context_length=context) as model:
    out = {"load_s": time.perf_counter() - t0,
           "route": {"backend": model.info.get("backend"), "route": model.info.get("route")}}
    bias = {t: float("-inf") for t in model.tokenize("<|endoftext|><|im_end|>",
                                                     parse_special=True)}
    if kind == "bursts":
        rates = []
        for _ in range(bursts):
            t = time.perf_counter()
            results = model.generate_many(fresh(parallel), max_new_tokens=new,
                                          temperature=0, logit_bias=bias)
            done = sum(r.stats.completion_tokens for r in results)
            rates.append(done / (time.perf_counter() - t))
        out["bursts_tok_s"] = rates
    else:
        ttfts = [model.generate_many(fresh(1), max_new_tokens=8, temperature=0,
                                     logit_bias=bias)[0].stats.ttft_s for _ in range(4)]
        out["first_ttft_s"], out["later_ttft_s"] = ttfts[0], statistics.median(ttfts[1:])
print(json.dumps(out))
"""


def _process(kind: str, context: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    values = (kind, args.parallel, context, args.prompt_tokens, args.new_tokens, args.threads,
              args.bursts, seed)  # fmt: skip
    command = [sys.executable, "-c", _RUN, *map(str, values)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the {kind} run at context {context} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def run(context: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One round at ``context`` tokens per slot: a bursts process and a one-request one."""
    bursts = _process("bursts", context, args, seed)
    alone = _process("alone", context, args, seed + 1)
    return {**bursts, "first_ttft_s": alone["first_ttft_s"], "later_ttft_s": alone["later_ttft_s"]}


def _range(values: Any) -> list[float]:
    ordered = sorted(values)
    return [ordered[0], ordered[-1]]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of one case, and the ratios of those medians."""
    first = statistics.median(r["bursts_tok_s"][0] for r in runs)
    later = [x for r in runs for x in r["bursts_tok_s"][1:]]
    first_ttft = statistics.median(r["first_ttft_s"] for r in runs)
    later_ttft = statistics.median(r["later_ttft_s"] for r in runs)
    return {
        "first_burst_tok_s": first,
        "later_tok_s": statistics.median(later),
        "later_range_tok_s": _range(later),
        "first_over_later": first / statistics.median(later),
        "first_ttft_s": first_ttft,
        "later_ttft_s": later_ttft,
        "first_ttft_over_later": first_ttft / later_ttft,
        "first_ttft_range_s": _range(r["first_ttft_s"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="512,2048", help="tokens per slot, comma-separated")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=4, help="the first one included")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.bursts < 2:
        parser.error("--bursts must be at least 2: the first burst and a later one")
    contexts = [int(c) for c in args.contexts.split(",")]
    measured = conditions.start(args.threads, args.rounds)
    runs: dict[str, list[dict[str, Any]]] = {str(c): [] for c in contexts}
    for r in range(args.rounds):
        for c in contexts if r % 2 == 0 else contexts[::-1]:
            out = run(c, args, seed=1000 * r + c)
            runs[str(c)].append(out)
            print(f"round {r + 1}, context {c}: bursts "
                  f"{', '.join(f'{x:.1f}' for x in out['bursts_tok_s'])} tok/s, first request "
                  f"{out['first_ttft_s'] * 1000:.0f} ms, later {out['later_ttft_s'] * 1000:.0f} ms",
                  file=sys.stderr)  # fmt: skip
    record = {
        "what": "the first burst of N requests after a fresh start against the later bursts "
        "(every burst reads new prompts), and the first request's time to first token against "
        "a later one's",
        "model": "smollm2-135m-instruct",
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "summary": {c: summary(rs) for c, rs in runs.items()},
        "runs": runs,
        "conditions": conditions.finish(measured),
    }
    conditions.write(args.output, record)
    for c, s in record["summary"].items():
        print(f"context {c}: first burst {s['first_burst_tok_s']:.1f} tok/s, later "
              f"{s['later_tok_s']:.1f} ({s['first_over_later']:.2f}x); first request's TTFT "
              f"{s['first_ttft_over_later']:.2f}x a later one's")  # fmt: skip


if __name__ == "__main__":
    main()
