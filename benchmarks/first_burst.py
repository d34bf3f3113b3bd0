"""The first burst after a fresh start against the later ones: no cold shapes.

Each run is a fresh process that loads the default model with ``parallel=N`` and then, with
nothing run before it:

1. one request alone (its time to first token: the first request after a start);
2. ``--bursts`` bursts of N requests at once (``generate_many``), each request a prompt of
   its own that no earlier burst read, so every burst reads its prompts (no cached prefix)
   and meets the shapes a slot engine meets: prompt chunks beside decode rows, 1 to N rows;
3. one request alone again (the same length: a later first token).

A burst's rate is its completion tokens over its wall time, prompts included. The figures
are the first burst's rate over the median of the later bursts' and the first request's time
to first token over the later one's; at 1.0 a start costs nothing. Rounds alternate the
cases, each a fresh process.

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
import json, sys, time
import numpy as np
import edgeinfer

parallel, context, prompt, new, threads, bursts = map(int, sys.argv[1:7])
rng = np.random.default_rng(int(sys.argv[7]))

def fresh(n):
    return [[int(t) for t in rng.integers(100, 40000, prompt)] for _ in range(n)]

def alone(model, bias):
    (result,) = model.generate_many(fresh(1), max_new_tokens=8, temperature=0,
                                    logit_bias=bias)
    return result.stats.ttft_s

t0 = time.perf_counter()
with edgeinfer.load("smollm2-135m-instruct", threads=threads, parallel=parallel,
                    context_length=context) as model:
    load_s = time.perf_counter() - t0
    bias = {t: float("-inf") for t in model.tokenize("<|endoftext|><|im_end|>",
                                                     parse_special=True)}
    first_ttft = alone(model, bias)
    rates = []
    for _ in range(bursts):
        t = time.perf_counter()
        results = model.generate_many(fresh(parallel), max_new_tokens=new, temperature=0,
                                      logit_bias=bias)
        done = sum(r.stats.completion_tokens for r in results)
        rates.append(done / (time.perf_counter() - t))
    later_ttft = alone(model, bias)
    route = {"backend": model.info.get("backend"), "route": model.info.get("route")}
print(json.dumps({"load_s": load_s, "first_ttft_s": first_ttft, "later_ttft_s": later_ttft,
                  "bursts_tok_s": rates, "route": route}))
"""


def run(context: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One fresh process at ``context`` tokens per slot: its figures."""
    values = (args.parallel, context, args.prompt_tokens, args.new_tokens, args.threads,
              args.bursts, seed)  # fmt: skip
    command = [sys.executable, "-c", _RUN, *map(str, values)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the run at context {context} failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.splitlines()[-1])
    later = statistics.median(out["bursts_tok_s"][1:])
    out["first_over_later"] = out["bursts_tok_s"][0] / later
    out["first_ttft_over_later"] = out["first_ttft_s"] / out["later_ttft_s"]
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the rounds of one case."""
    keys = ("first_over_later", "first_ttft_over_later", "first_ttft_s", "later_ttft_s")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["first_burst_tok_s"] = statistics.median(r["bursts_tok_s"][0] for r in runs)
    out["later_tok_s"] = statistics.median(statistics.median(r["bursts_tok_s"][1:]) for r in runs)
    return out


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
