"""The ONNX route's KV cache in untouched pages against numpy's zeroed arrays: peak RSS and
decode rate, one stream at a long context and eight streams at 2,048.

numpy advises transparent huge pages for large arrays; a KV tensor's row per head is 2 MiB at
8,192 positions, so with huge pages the first token written makes the whole cache resident.
``runtimes/onnx_slots.untouched_zeros`` maps the cache anonymously, out of huge pages, so
only the pages written are resident. Each run is a fresh process (the kinds alternate),
timed per burst of requests: the first burst after load apart, then the median of the rest.

    python benchmarks/kv_pages.py [--rounds 4] [--threads 2]
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

RESULTS = Path(__file__).parent / "results" / "kv_pages.json"
KINDS = ("numpy", "untouched")  # numpy.zeros (numpy advises huge pages), the backend's own
CASES = {  # name: (parallel, context, new tokens)
    "one stream at 8192": (1, 8192, 128),
    "8 streams at 2048": (8, 2048, 64),
}

_RUN = r"""
import json, statistics, sys, time
import numpy as np
import edgeinfer
import edgeinfer.runtimes.onnx_slots as slots

kind, parallel, context, new, threads = sys.argv[1], *map(int, sys.argv[2:6])
if kind == "numpy":
    slots.untouched_zeros = lambda shape, dtype: np.zeros(shape, dtype)
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(100, 40000, 128)] for _ in range(parallel)]
with edgeinfer.load("smollm2-135m-instruct", threads=threads, parallel=parallel,
                    context_length=context) as model:
    rates = []
    for burst in range(4):
        t = time.perf_counter()
        results = model.generate_many(prompts, max_new_tokens=new, temperature=0)
        rates.append(sum(r.stats.completion_tokens for r in results) / (time.perf_counter() - t))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"first_burst_tok_s": rates[0], "later_tok_s": statistics.median(rates[1:]),
                  "bursts_tok_s": rates, "peak_rss_mb": int(status["VmHWM"].split()[0]) / 1024}))
"""


def run(kind: str, case: tuple[int, int, int], threads: int) -> dict[str, Any]:
    parallel, context, new = case
    command = [sys.executable, "-c", _RUN, kind, str(parallel), str(context), str(new)]
    done = subprocess.run([*command, str(threads)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    cases = {name: CASES[name] for name in args.cases.split(",")}
    cond = conditions.start(args.threads, args.rounds)
    runs = []
    for n in range(args.rounds):
        for name, case in cases.items():
            for kind in KINDS:
                row = {"round": n, "case": name, "kind": kind, **run(kind, case, args.threads)}
                runs.append(row)
                print(json.dumps(row), file=sys.stderr)
    summary: dict[str, Any] = {}
    for name in cases:
        by = {k: [r for r in runs if r["case"] == name and r["kind"] == k] for k in KINDS}
        summary[name] = {
            kind: {
                key: statistics.median(r[key] for r in rows)
                for key in ("peak_rss_mb", "first_burst_tok_s", "later_tok_s")
            }
            for kind, rows in by.items()
        }
        old = summary[name]["numpy"]
        summary[name]["ratio_to_numpy"] = {
            kind: {key: summary[name][kind][key] / old[key] for key in old} for kind in KINDS[1:]
        }
    record = {
        "what": "the ONNX route's KV cache as numpy zeros (huge pages advised) against "
        "untouched anonymous pages: peak RSS, first burst and later bursts' decode rate",
        "model": "smollm2-135m-instruct",
        "cases": {
            name: dict(zip(("parallel", "context", "new_tokens"), case, strict=True))
            for name, case in cases.items()
        },
        "summary": summary,
        "runs": runs,
        "conditions": conditions.finish(cond),
    }
    conditions.write(args.output, record)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
