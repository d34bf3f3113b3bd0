"""A batch job against a loop: 1,000 short support tickets, each classified into one of five
labels with a ``choice`` response_format, on the default model.

- loop: one process loads the model (parallel=1) and calls ``model.chat()`` once per ticket,
  in order (what a script does without ``edgeinfer batch``);
- batch: ``edgeinfer batch MODEL IN.jsonl -o OUT.jsonl --parallel N`` as a user runs it.

Both run greedy on the same threads; each is a fresh process, timed from the first request
to the last record (model loading is reported apart). Rounds alternate loop and batch.
The labels of the two runs are compared too (how often a row's label is the same).

    python benchmarks/batch_job.py [--rows 1000] [--parallel 8] [--threads 2] [--rounds 1]
                                   [--context-length 1024]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from conditions import finish, start, write

RESULTS = Path(__file__).parent / "results" / "batch_job.json"
LABELS = ["billing", "bug", "account", "feature", "other"]
SYSTEM = (
    "You sort customer support tickets. Answer with one word: billing, bug, account, "
    "feature or other."
)
_SUBJECTS = [
    "I was charged twice for my subscription this month",
    "The app crashes when I open the settings page",
    "I cannot log in after changing my password",
    "Please add a dark mode to the dashboard",
    "Where is your office located?",
    "My invoice shows the wrong VAT number",
    "Export to CSV produces an empty file",
    "How do I delete my account and all my data?",
    "It would be great to schedule reports weekly",
    "Thanks for the quick help yesterday",
]
_DETAILS = ["", " since Monday", " on my phone", " for order {n}", " (ticket {n})", " again"]

_LOOP = """
import json, sys, time
import edgeinfer
rows = [json.loads(line) for line in open(sys.argv[2])]
t0 = time.perf_counter()
model = edgeinfer.load(sys.argv[1], threads=int(sys.argv[3]), context_length=int(sys.argv[4]))
t1 = time.perf_counter()
labels = []
for row in rows:
    result = model.chat(row["messages"], temperature=0, response_format=row["response_format"],
                        max_new_tokens=row["max_tokens"])
    labels.append(result.text)
t2 = time.perf_counter()
route = {"backend": model.info.get("backend"), "route": model.info.get("route")}
print(json.dumps({"load_s": t1 - t0, "job_s": t2 - t1, "labels": labels, "route": route}))
"""


def tickets(n: int) -> list[dict[str, Any]]:
    fmt = {"type": "choice", "choices": LABELS}
    rows = []
    for i in range(n):
        text = _SUBJECTS[i % len(_SUBJECTS)] + _DETAILS[(i // 10) % len(_DETAILS)]
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": text.format(n=1000 + i)},
        ]
        rows.append({"id": i, "messages": messages, "response_format": fmt, "max_tokens": 4})
    return rows


def _script(script: str, *args: object) -> dict[str, Any]:
    """The JSON last line of ``script`` run in a fresh process with ``args``."""
    command = [sys.executable, "-c", script, *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def run_loop(model: str, src: Path, threads: int, context: int) -> dict[str, Any]:
    return _script(_LOOP, model, src, threads, context)


def run_batch(
    model: str, src: Path, out: Path, parallel: int, threads: int, context: int
) -> dict[str, Any]:
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    command = [sys.executable, "-m", "edgeinfer", "batch", model, str(src), "-o", str(out)]
    command += ["--parallel", str(parallel), "--threads", str(threads), "--temperature", "0"]
    command += ["--context-length", str(context), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"edgeinfer batch failed: {done.stderr[-2000:]}")
    # the job's own time, from its summary line: "... in 52.1 s (...)"
    match = re.search(r" in ([0-9.]+) s \(", done.stderr)
    job_s = float(match.group(1)) if match else wall
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {
        "wall_s": wall,
        "job_s": job_s,
        "labels": [r["text"] for r in records],
        "errors": sum(r["error"] is not None for r in records),
    }


_ROUTE = """
import json, sys
import edgeinfer
with edgeinfer.load(sys.argv[1], threads=int(sys.argv[2]), context_length=int(sys.argv[3]),
                    parallel=int(sys.argv[4])) as model:
    print(json.dumps({"backend": model.info.get("backend"), "route": model.info.get("route")}))
"""


def batch_route(model: str, parallel: int, threads: int, context: int) -> dict[str, Any]:
    """The route ``edgeinfer batch --parallel N`` opens: the same ``load()`` options."""
    return _script(_ROUTE, model, threads, context, parallel)


def _engine(route: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two routes the same: the backend and the files it runs (the route's "why"
    differs between one sequence and N, whatever the engine)."""
    where = route.get("route") or {}
    return route.get("backend"), where.get("format"), where.get("from")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--context-length", type=int, default=1024, help="per sequence")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    conditions = start(args.threads, args.rounds)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tickets.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in tickets(args.rows)))
        for r in range(args.rounds):
            loop = run_loop(args.model, src, args.threads, args.context_length)
            out = Path(tmp) / "out.jsonl"
            batch = run_batch(
                args.model, src, out, args.parallel, args.threads, args.context_length
            )
            pairs = list(zip(loop["labels"], batch["labels"], strict=True))
            same = sum(a == b for a, b in pairs)
            rounds.append(
                {
                    "loop_job_s": loop["job_s"],
                    "loop_load_s": loop["load_s"],
                    "batch_job_s": batch["job_s"],
                    "batch_wall_s": batch["wall_s"],
                    "batch_errors": batch["errors"],
                    "speedup": loop["job_s"] / batch["job_s"],
                    "labels_same": same / args.rows,
                    "label_counts_batch": {k: batch["labels"].count(k) for k in LABELS},
                    "rows_differing": [i for i, (a, b) in enumerate(pairs) if a != b][:50],
                    "loop_route": loop["route"],
                }
            )
            print(f"round {r + 1}: {json.dumps(rounds[-1])}", file=sys.stderr)
    conditions = finish(conditions)
    route = batch_route(args.model, args.parallel, args.threads, args.context_length)
    result = {
        "what": "1,000 ticket classifications (choice of 5 labels): edgeinfer batch --parallel "
        "N against a loop of model.chat() calls, same model, greedy, same threads",
        "command": " ".join(["python", "benchmarks/batch_job.py", *sys.argv[1:]]),
        "settings": vars(args) | {"out": str(args.out)},
        "conditions": conditions,
        "batch_route": route,
        "same_route": all(_engine(r["loop_route"]) == _engine(route) for r in rounds),
        "rounds": rounds,
        "median_speedup": statistics.median(r["speedup"] for r in rounds),
        "median_batch_rows_per_s": statistics.median(args.rows / r["batch_job_s"] for r in rounds),
        "median_loop_rows_per_s": statistics.median(args.rows / r["loop_job_s"] for r in rounds),
    }
    write(args.out, result)
    print(
        f"batch --parallel {args.parallel}: {result['median_batch_rows_per_s']:.1f} rows/s, "
        f"loop: {result['median_loop_rows_per_s']:.1f} rows/s, "
        f"speedup {result['median_speedup']:.2f}x -> {args.out}"
    )


if __name__ == "__main__":
    main()
