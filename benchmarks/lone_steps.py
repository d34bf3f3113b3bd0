"""What pairing a lone sequence's step with a spare row costs on the ONNX route.

Where onnxruntime computes a one-row step with another kernel than a longer step, the backend
pairs every lone step with a spare cache row (``runtimes/onnx_slots.py``; ``model.info
["lone_steps"]``). This measures one stream's decode of the default model with the pairing
switched on and off by hand, whatever the load probe chose, interleaved round by round, on
the backend's own step (no sampling): the price paid on CPUs that need it, measured here.

    python benchmarks/lone_steps.py --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import edgeinfer
from edgeinfer.files.catalog import DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions

OUT = Path(__file__).parent / "results" / "lone_steps.json"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def decode_rate(backend: Any, prompt: list[int], steps: int, paired: bool) -> float:
    """Tokens per second of ``steps`` one-token steps after ``prompt``, pairing on or off."""
    backend.rewind(0, 0)
    backend._pair(paired)
    backend.prefill(prompt, 0)
    start = time.perf_counter()
    for i in range(steps):
        backend.decode(100 + i % 1000, 0)
    return steps / (time.perf_counter() - start)


def measure(threads: int, rounds: int, steps: int) -> dict[str, Any]:
    with edgeinfer.load(DEFAULT_MODEL, engine="onnxruntime", threads=threads) as model:
        backend = model._backend
        probe = model.info["lone_steps"]
        prompt = model.tokenize(PROMPT)
        decode_rate(backend, prompt, 16, True)  # both shapes planned once
        decode_rate(backend, prompt, 16, False)
        rates: dict[str, list[float]] = {"alone": [], "paired": []}
        for r in range(rounds):
            order = ("alone", "paired") if r % 2 == 0 else ("paired", "alone")
            for mode in order:
                rates[mode].append(decode_rate(backend, prompt, steps, mode == "paired"))
    ratios = [p / a for p, a in zip(rates["paired"], rates["alone"], strict=True)]
    return {
        "threads": threads,
        "probe_here": probe,
        "alone_tok_s": [round(x, 2) for x in rates["alone"]],
        "paired_tok_s": [round(x, 2) for x in rates["paired"]],
        "alone_median_tok_s": round(statistics.median(rates["alone"]), 1),
        "paired_median_tok_s": round(statistics.median(rates["paired"]), 1),
        "paired_over_alone_median": round(statistics.median(ratios), 3),
        "paired_over_alone_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=192, help="decode steps per run")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    args = parser.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    cond = conditions.start(max(counts), args.rounds)
    results = [measure(t, args.rounds, args.steps) for t in counts]
    record = {
        "what": "one stream decoding on the ONNX route: lone steps alone vs paired",
        "model": DEFAULT_MODEL,
        "steps": args.steps,
        "results": results,
        "conditions": conditions.finish(cond),
    }
    conditions.write(args.output, record)
    for r in results:
        print(
            f"threads {r['threads']}: paired/alone {r['paired_over_alone_median']}", file=sys.stderr
        )
    print(f"written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
