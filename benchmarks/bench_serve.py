"""What `edgeinfer serve` adds per streamed token over the Python API, on the default model.

Starts the server on a free loopback port (a process of its own, 2 threads) and, in
alternating rounds, streams the same greedy completion (end of generation banned, so every
round generates -n tokens) through the Python API in this process and through the server
with httpx reading the server-sent events. The decode step is (last - first stamp) / (n - 1)
on each side; the server's added latency per token is the difference of the medians.

    python benchmarks/bench_serve.py [-n 128] [--rounds 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _steps(stamps: list[float]) -> float:
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "serve.json"
    )
    args = parser.parse_args()
    import httpx

    import edgeinfer
    from edgeinfer import catalog

    gguf = catalog.fetch(catalog.DEFAULT_MODEL)
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer.cli", "serve", str(gguf), "--port", str(port),
         "--threads", str(args.threads), "--context-length", "1024"],
        stderr=subprocess.DEVNULL, env={**os.environ},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        model = edgeinfer.load(gguf, context_length=1024, threads=args.threads)
        eos = {i: float("-inf") for i in (0, 2)}
        body = {
            "prompt": PROMPT,
            "max_tokens": args.n,
            "temperature": 0,
            "logit_bias": {str(i): -100 for i in eos},
            "stream": True,
        }
        api: list[float] = []
        served: list[float] = []
        with httpx.Client(timeout=120) as client:
            for r in range(args.rounds + 1):  # round 0 warms both sides up
                stamps = []
                for chunk in model.stream(
                    PROMPT, temperature=0, max_new_tokens=args.n, logit_bias=eos
                ):
                    if chunk.token_ids:
                        stamps.append(time.perf_counter())
                step_api = _steps(stamps)
                stamps = []
                with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            stamps.append(time.perf_counter())
                step_served = _steps(stamps)
                if r:
                    api.append(step_api)
                    served.append(step_served)
        model.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    api_ms = statistics.median(api) * 1000
    served_ms = statistics.median(served) * 1000
    report: dict[str, Any] = {
        "model": catalog.DEFAULT_MODEL,
        "threads": args.threads,
        "tokens": args.n,
        "rounds": args.rounds,
        "api_step_ms": [round(x * 1000, 3) for x in api],
        "server_step_ms": [round(x * 1000, 3) for x in served],
        "api_median_ms": round(api_ms, 3),
        "server_median_ms": round(served_ms, 3),
        "added_ms_per_token": round(served_ms - api_ms, 3),
        "added_fraction": round((served_ms - api_ms) / api_ms, 4),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"decode step: Python API {api_ms:.2f} ms, server {served_ms:.2f} ms; added "
        f"{served_ms - api_ms:+.2f} ms per token ({report['added_fraction']:+.1%})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
