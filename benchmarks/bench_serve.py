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


def _start_server(gguf: Path, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    """``edgeinfer serve`` on a free loopback port, answering /health: (process, base URL)."""
    import httpx

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer.cli", "serve", str(gguf), "--port", str(port),
         "--threads", str(threads), "--context-length", "1024"],
        stderr=subprocess.DEVNULL, env={**os.environ},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return server, url


def _api_step(model: Any, n: int, eos: dict[int, float]) -> float:
    """One greedy completion through the Python API: its decode step, seconds."""
    stamps = []
    for chunk in model.stream(PROMPT, temperature=0, max_new_tokens=n, logit_bias=eos):
        if chunk.token_ids:
            stamps.append(time.perf_counter())
    return _steps(stamps)


def _served_step(client: Any, url: str, body: dict[str, Any]) -> float:
    """The same completion through the server's SSE: its decode step, seconds."""
    stamps = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return _steps(stamps)


def _measure(gguf: Path, url: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Alternating rounds, API then server: (API steps, server steps), round 0 left out."""
    import httpx

    import edgeinfer

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
    with model, httpx.Client(timeout=120) as client:
        for r in range(args.rounds + 1):  # round 0 warms both sides up
            step_api = _api_step(model, args.n, eos)
            step_served = _served_step(client, url, body)
            if r:
                api.append(step_api)
                served.append(step_served)
    return api, served


def _report(
    args: argparse.Namespace, model: str, api: list[float], served: list[float]
) -> dict[str, Any]:
    api_ms = statistics.median(api) * 1000
    served_ms = statistics.median(served) * 1000
    return {
        "model": model,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "serve.json"
    )
    args = parser.parse_args()
    from edgeinfer.files import catalog

    gguf = catalog.fetch(catalog.DEFAULT_MODEL)
    server, url = _start_server(gguf, args.threads)
    try:
        api, served = _measure(gguf, url, args)
    finally:
        server.terminate()
        server.wait(timeout=30)
    report = _report(args, catalog.DEFAULT_MODEL, api, served)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"decode step: Python API {report['api_median_ms']:.2f} ms, server "
        f"{report['server_median_ms']:.2f} ms; added {report['added_ms_per_token']:+.2f} ms "
        f"per token ({report['added_fraction']:+.1%})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
