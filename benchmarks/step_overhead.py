"""Where a batched step's time goes at N slots: the engine's forward pass and the Python
around it, per route.

Loads the default model with ``parallel=N`` on each route in turn, runs bursts of N greedy
requests (end of generation banned, so every request decodes the same count), and times
each call of the backend's ``decode_many`` (one forward pass over one token of each of the
N sequences) and the gap from its end to the next call's start: the generation loop's own
work per step (sampling N rows, delivering their text, the scheduler). Only steps where all
N sequences decode are counted.

    python benchmarks/step_overhead.py [--parallel 8] [--rounds 3] [--threads 2]
        [--routes onnxruntime,llama.cpp] [-o benchmarks/results/step_overhead.json]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import conditions

import edgeinfer

RESULTS = Path(__file__).parent / "results" / "step_overhead.json"
WORDS = ("cat", "dog", "fox", "owl", "bear", "wolf", "hare", "crow", "seal", "lynx", "mole", "newt")


def measure(route: str, args: argparse.Namespace) -> dict[str, Any]:
    """One route: per full step, the forward pass and the loop's work after it (ms)."""
    calls: list[tuple[float, float, int]] = []  # (start, seconds, rows)
    with edgeinfer.load(args.model, engine=route, parallel=args.parallel, threads=args.threads,
                        context_length=512) as model:  # fmt: skip
        backend = model._backend
        forward = backend.decode_many

        def timed(steps: Any) -> Any:
            start = time.perf_counter()
            rows = forward(steps)
            calls.append((start, time.perf_counter() - start, len(steps)))
            return rows

        backend.decode_many = timed
        eos = {t: -100.0 for t in model.tokenize("<|endoftext|><|im_start|><|im_end|>",
                                                 parse_special=True)}  # fmt: skip
        bursts = []
        for r in range(args.rounds + 1):  # the first burst warms up, not counted
            prompts = [f"Round {r}: write a short story about a {WORDS[i % len(WORDS)]} who "
                       "learns to sail." for i in range(args.parallel)]  # fmt: skip
            calls.clear()
            model.generate_many(prompts, max_new_tokens=args.new_tokens, temperature=0,
                                logit_bias=eos)  # fmt: skip
            full = [c for c in calls if c[2] == args.parallel]
            gaps = [b[0] - (a[0] + a[1]) for a, b in itertools.pairwise(full)]
            if r:
                bursts.append({"forward_ms": [c[1] * 1000 for c in full],
                               "between_ms": [g * 1000 for g in gaps]})  # fmt: skip
        info = {"backend": model.info.get("backend"), "route": model.info.get("route")}
    forward_ms = [x for b in bursts for x in b["forward_ms"]]
    between_ms = [x for b in bursts for x in b["between_ms"]]
    fwd, gap = statistics.median(forward_ms), statistics.median(between_ms)
    return {"route": route, "info": info, "steps": len(forward_ms),
            "forward_ms_median": fwd, "between_ms_median": gap,
            "between_share": gap / (fwd + gap), "bursts": bursts}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--routes", default="onnxruntime,llama.cpp")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    cond = conditions.start(args.threads, args.rounds)
    routes = [measure(route, args) for route in args.routes.split(",")]
    for r in routes:
        print(f"{r['route']}: forward {r['forward_ms_median']:.2f} ms, the loop's work "
              f"{r['between_ms_median']:.2f} ms a step ({r['between_share']:.1%})")  # fmt: skip
    record = {
        "what": "a batched step at N slots: the forward pass (decode_many) and the generation "
        "loop's work between two passes, medians over the steps where all N sequences decode",
        "model": args.model,
        "parallel": args.parallel,
        "new_tokens": args.new_tokens,
        "routes": routes,
        "conditions": conditions.finish(cond),
    }
    conditions.write(args.output, record)


if __name__ == "__main__":
    main()
