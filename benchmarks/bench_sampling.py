"""Cost of sampling one token against the cost of one decode step.

Sampling runs in numpy on the last position's logits. This measures the sampler alone on
logits taken from the default model (49,152-token vocabulary) for each kind of setting, and
one decode step of the default GGUF model on the same machine, and prints the ratio.

    python benchmarks/bench_sampling.py [--threads 2] [--steps 2000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import edgeinfer
from edgeinfer.generation.sampling import Sampler, SamplingConfig

SETTINGS: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0},
    "defaults (T 0.8, top-k 40, top-p 0.95)": {},
    "top-k 0, top-p 0.9 (nucleus over the whole vocabulary)": {"top_k": 0, "top_p": 0.9},
    "min-p 0.05, top-k 0, top-p 1": {"min_p": 0.05, "top_k": 0, "top_p": 1.0},
    "repetition penalty 1.3 (window 64)": {"repetition_penalty": 1.3},
    "logit bias on 3 ids": {"logit_bias": {0: -100.0, 1: -100.0, 2: -100.0}},
    "everything at once": {
        "top_k": 0, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.2,
        "logit_bias": {0: -100.0, 1: -100.0, 2: -100.0},
    },
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sampling.json")
    args = ap.parse_args()
    with edgeinfer.load("smollm2-135m-instruct", context_length=1024, threads=args.threads) as m:
        backend = m._backend
        prompt = m.tokenize("Once upon a time, in a small village by the sea, there lived")
        logits_rows = [np.array(backend.prefill(prompt), dtype=np.float32)]
        token = int(np.argmax(logits_rows[0]))
        decode_times = []
        for _ in range(64):
            t = time.perf_counter()
            out = backend.decode(token)
            decode_times.append(time.perf_counter() - t)
            logits_rows.append(np.array(out, dtype=np.float32))
            token = int(np.argmax(out))
        vocab = m.info["vocab_size"]
    decode_us = statistics.median(decode_times) * 1e6
    history = list(range(1000, 1064))
    rows = []
    print(f"decode step (default GGUF, {args.threads} threads): {decode_us:.0f} us (median)")
    print(f"{'sampling':<56} {'us/token':>9} {'of a decode step':>17}")
    for name, kwargs in SETTINGS.items():
        sampler = Sampler(SamplingConfig(seed=0, **kwargs), vocab)  # type: ignore[arg-type]
        times = []
        for i in range(args.steps):
            logits = logits_rows[i % len(logits_rows)]
            t = time.perf_counter()
            sampler(logits, history)
            times.append(time.perf_counter() - t)
        us = statistics.median(times) * 1e6
        rows.append({"setting": name, "median_us": us, "share_of_decode": us / decode_us})
        print(f"{name:<56} {us:>9.0f} {us / decode_us:>16.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"machine": platform.machine(), "python": sys.version.split()[0],
             "vocab": vocab, "decode_step_us": decode_us, "rows": rows},
            indent=1,
        ) + "\n"
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
