"""Decode speed of the default model idle and beside a CPU hog, default settings against each
explicit thread count, both routes (llama.cpp on the GGUF, onnxruntime on its exact ONNX
transcode).

    python benchmarks/busy_cpu.py                       # 3 rounds, hogs 0/1/2, t=default/1/2
    python benchmarks/busy_cpu.py --rounds 5 --settings default,t1,t2,t2:OMP_WAIT_POLICY=PASSIVE

A hog is a plain Python busy loop in its own process, started by this script. "Idle" means no
hog of ours: other processes on a shared machine still run, so the load average is recorded
beside every run. One fresh process per run; conditions, routes and settings are interleaved
(round after round), and medians are reported. A setting is "default" (threads=None, the
library's choice), "tN" (threads=N) or either followed by ":KEY=VALUE" environment entries.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
ROUTES = ("llama.cpp", "onnxruntime")
RESULTS = Path(__file__).parent / "results" / "busy_cpu.json"
_MARK = "busy-cpu-result "


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in this (fresh) process: load, 128 greedy tokens with EOS banned, figures."""
    import edgeinfer
    from edgeinfer.bench.workload import end_of_generation_ids, prompt_ids

    t_load = time.perf_counter()
    with edgeinfer.load(
        MODEL, device="cpu", context_length=1024, threads=spec["threads"], engine=spec["route"]
    ) as model:
        load_s = time.perf_counter() - t_load
        ids = prompt_ids(model, spec["prompt_tokens"])
        ban = {t: float("-inf") for t in end_of_generation_ids(model)}
        stamps: list[float] = []
        t0 = time.perf_counter()
        for chunk in model.stream(
            ids, max_new_tokens=spec["new_tokens"], temperature=0, logit_bias=ban
        ):
            if chunk.token_ids:
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
        info = model.info
    span = stamps[-1] - stamps[0]
    return {
        "threads_used": info.get("threads"),
        "threads_why": info.get("threads_why"),
        "load_s": round(load_s, 3),
        "ttft_s": round(stamps[0] - t0, 4),
        "decode_tok_s": round((len(stamps) - 1) / span, 2) if span > 0 else 0.0,
        "tokens": len(stamps),
    }


def _hog() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _parse_setting(text: str) -> tuple[int | None, dict[str, str]]:
    head, *env = text.split(":")
    threads = None if head == "default" else int(head.removeprefix("t"))
    return threads, dict(item.split("=", 1) for item in env)


def _run_one(route: str, setting: str, args: argparse.Namespace) -> dict[str, Any]:
    threads, env = _parse_setting(setting)
    spec = {"route": route, "threads": threads, "prompt_tokens": 128, "new_tokens": args.tokens}
    load_before = os.getloadavg()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=args.run_timeout,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.run_timeout} s", "loadavg_before": load_before}
    lines = [x for x in proc.stdout.splitlines() if x.startswith(_MARK)]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return {**json.loads(lines[-1][len(_MARK) :]), "loadavg_before": load_before}


def _round(args: argparse.Namespace, n: int, runs: list[dict[str, Any]]) -> None:
    for hogs in args.hogs:
        procs = [_hog() for _ in range(hogs)]
        try:
            time.sleep(1.0)  # let the scheduler see the hogs
            for route in args.routes:
                for setting in args.settings:
                    run = _run_one(route, setting, args)
                    run.update(round=n, hogs=hogs, route=route, setting=setting)
                    runs.append(run)
                    print(json.dumps(run), file=sys.stderr, flush=True)
        finally:
            for p in procs:
                p.kill()
                p.wait()


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median decode tok/s per (route, hogs, setting), and default / best explicit threads."""
    rows: list[dict[str, Any]] = []
    keys = sorted({(r["route"], r["hogs"]) for r in runs})
    for route, hogs in keys:
        medians: dict[str, float] = {}
        for setting in dict.fromkeys(r["setting"] for r in runs):
            # a run that failed (past --run-timeout) counts as 0 tok/s: slower than any other
            vals = [
                r.get("decode_tok_s", 0.0)
                for r in runs
                if (r["route"], r["hogs"], r["setting"]) == (route, hogs, setting)
            ]
            if vals:
                medians[setting] = round(statistics.median(vals), 2)
        explicit = {s: v for s, v in medians.items() if s.startswith("t") and ":" not in s}
        best = max(explicit, key=explicit.__getitem__) if explicit else None
        row: dict[str, Any] = {"route": route, "hogs": hogs, "median_decode_tok_s": medians}
        failed = {
            r["setting"]: r["error"] for r in runs if (r["route"], r["hogs"]) == (route, hogs)
            and "error" in r
        }  # fmt: skip
        if failed:  # runs past --run-timeout, counted as 0 tok/s in the medians
            row["failed"] = failed
        if best and "default" in medians:
            row["best_threads"] = best
            row["default_vs_best"] = round(medians["default"] / explicit[best], 3)
        rows.append(row)
    return rows


def _machine() -> dict[str, Any]:
    import edgeinfer

    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "edgeinfer": getattr(edgeinfer, "__version__", "dev"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--hogs", default="0,1,2")
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--settings", default="default,t1,t2")
    parser.add_argument("-o", "--out", type=Path, default=RESULTS)
    parser.add_argument("--resummarise", type=Path, help="recompute a results file's summary")
    args = parser.parse_args()
    if args.resummarise:
        data = json.loads(args.resummarise.read_text())
        data["summary"] = summarise(data["runs"])
        args.resummarise.write_text(json.dumps(data, indent=1) + "\n")
        print(json.dumps(data["summary"], indent=1))
        return 0
    if args.worker:
        print(_MARK + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    args.hogs = [int(x) for x in args.hogs.split(",")]
    args.routes = args.routes.split(",")
    args.settings = args.settings.split(",")
    runs: list[dict[str, Any]] = []
    load_start = os.getloadavg()
    for n in range(args.rounds):
        _round(args, n, runs)
        result = _write(args, runs, load_start, rounds_done=n + 1)  # each round: a partial run
    print(json.dumps(result["summary"], indent=1))
    return 0


def _write(
    args: argparse.Namespace, runs: list[dict[str, Any]], load_start: Any, rounds_done: int
) -> dict[str, Any]:
    result = {
        "command": "python benchmarks/busy_cpu.py " + " ".join(sys.argv[1:]),
        "machine": _machine(),
        "idle_means": "no hog of ours; other processes on the shared machine may run",
        "rounds_done": rounds_done,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "summary": summarise(runs),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
