"""How fast one sequence reads a prompt, by its length: the time to the first token of a
random prompt of N tokens (nothing reused: every prompt differs from the one before in its
first token), one stream, greedy, one new token.

Short prompts are what a classification job sends (``benchmarks/batch_job.py``: 44-48
tokens a row, 2 tokens out), so this says how much of such a job batching can share: decode
steps are shared by the rows of a batch, a prompt's read is not.

    python benchmarks/prefill_rate.py [--model NAME] [--lengths 16,32,...] [--rounds 5]
                                      [--threads 2] [--engine auto]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import conditions
import numpy as np

import edgeinfer

RESULTS = Path(__file__).parent / "results" / "prefill_rate.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", default="16,32,48,64,128,256,384")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    cond = conditions.start(args.threads, args.rounds)
    rows = []
    rng = np.random.default_rng(0)
    with edgeinfer.load(
        args.model, threads=args.threads, context_length=1024, engine=args.engine
    ) as model:
        vocab = model.info.get("vocab_size") or 32000
        model.generate([int(t) for t in rng.integers(100, vocab - 1, 64)], max_new_tokens=1)
        for n in lengths:
            ttft = []
            for _ in range(args.rounds):
                ids = [int(t) for t in rng.integers(100, vocab - 1, n)]
                result = model.generate(ids, max_new_tokens=1, temperature=0)
                assert result.stats.reused_prompt_tokens == 0
                ttft.append(result.stats.ttft_s)
            median = statistics.median(ttft)
            rows.append({"prompt_tokens": n, "ttft_s": ttft, "median_ttft_s": median,
                         "prefill_tok_s": n / median})  # fmt: skip
            print(f"{n:5d} tokens: {median * 1000:7.1f} ms, {n / median:6.0f} tok/s")
        route = model.info.get("backend")
    record = {
        "what": "one stream's prompt read by prompt length: time to the first token of a "
        "random prompt of N tokens, nothing reused",
        "model": args.model,
        "backend": route,
        "lengths": rows,
        "conditions": conditions.finish(cond),
    }
    conditions.write(args.output, record)


if __name__ == "__main__":
    main()
