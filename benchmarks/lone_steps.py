"""What pairing a lone sequence's step with a spare row costs on the ONNX route.

Where onnxruntime computes a one-row step with another kernel than a longer step, the backend
pairs every lone step with a spare cache row (``runtimes/onnx_slots.py``; ``model.info
["lone_steps"]``). This measures one stream's decode of the default model with the pairing
switched on and off by hand, whatever the load probe chose, interleaved round by round, on
the backend's own step (no sampling): the price paid on CPUs that need it, measured here.

With ``--streams N`` it measures N streams instead (``parallel=N``, greedy, through
``generate_many``): the requests ask for 1/2 to all of ``--steps`` new tokens, so as they
end the last ones step with fewer rows and the longest runs alone, the steps pairing
changes; the figure is the aggregate rate, paired over not, interleaved round by round.

    python benchmarks/lone_steps.py --rounds 8
    python benchmarks/lone_steps.py --streams 8 --threads 2 --steps 64 -o FILE
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
    return _figures(threads, probe, rates)


def streams_rate(model: Any, prompts: list[list[int]], steps: int, paired: bool) -> float:
    """Aggregate tokens per second of ``prompts`` run at once, pairing on or off; the
    requests' lengths spread from half of ``steps`` to all of it."""
    model._backend._pair(paired)
    n = len(prompts)
    requests = [{"prompt": p, "max_new_tokens": steps // 2 + (steps // 2) * i // max(n - 1, 1)}
                for i, p in enumerate(prompts)]  # fmt: skip
    start = time.perf_counter()
    results = model.generate_many(requests, temperature=0, logit_bias={0: -100.0, 2: -100.0})
    return sum(r.stats.completion_tokens for r in results) / (time.perf_counter() - start)


def measure_streams(threads: int, rounds: int, steps: int, streams: int) -> dict[str, Any]:
    with edgeinfer.load(DEFAULT_MODEL, engine="onnxruntime", threads=threads,
                        parallel=streams) as model:  # fmt: skip
        probe = model.info["lone_steps"]
        prompts = [model.tokenize(f"{PROMPT} ({i})") for i in range(streams)]
        streams_rate(model, prompts, 16, True)  # both settings' shapes planned once
        streams_rate(model, prompts, 16, False)
        rates: dict[str, list[float]] = {"alone": [], "paired": []}
        for r in range(rounds):
            for mode in ("alone", "paired") if r % 2 == 0 else ("paired", "alone"):
                rates[mode].append(streams_rate(model, prompts, steps, mode == "paired"))
    return _figures(threads, probe, rates) | {"streams": streams}


def _figures(threads: int, probe: str, rates: dict[str, list[float]]) -> dict[str, Any]:
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
    parser.add_argument("--streams", type=int, default=1, help="N streams at once (parallel=N)")
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    args = parser.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    cond = conditions.start(max(counts), args.rounds)
    if args.streams > 1:
        results = [measure_streams(t, args.rounds, args.steps, args.streams) for t in counts]
        what = f"{args.streams} streams on the ONNX route, lengths spread: lone steps or paired"
    else:
        results = [measure(t, args.rounds, args.steps) for t in counts]
        what = "one stream decoding on the ONNX route: lone steps alone vs paired"
    record = {
        "what": what,
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
