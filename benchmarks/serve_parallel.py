"""`edgeinfer serve --parallel N` under N concurrent streaming clients, on the default model.

Starts one server per --parallel value (each a process of its own on a free loopback port,
2 threads, the catalog name so the loader's route rule applies) and, in alternating rounds:

- burst: --clients concurrent streaming completions of -n greedy tokens each (end of
  generation banned, so each generates exactly -n), different prompts of equal length; the
  aggregate tokens/s (all tokens / wall time from the first request sent to the last token)
  and each request's TTFT (sent -> first streamed token) and decode tokens/s;
- join (on every server with more than one slot): the TTFT of one request sent alone to the
  idle server, and of the same-length request sent while clients - 1 other streams are
  decoding (the target: joined <= 2x alone).

Every prompt starts with a tag unique to its round and request, so no prompt is read from a
slot's cache. Round 0 is each server's first burst after its start: kept apart
("first_burst", with its ratio to the later rounds' median), left out of the medians and
min-max of the later rounds.

With --speculative MODE, a second edgeinfer server answers with ``--speculative MODE`` (the
default of requests that set none), in the same rounds: what speculation does to a server's
throughput at N streams.

With --peer-server, llama.cpp's own server (built from the llama.cpp that llama-cpp-python
vendors) serves the same GGUF with -np N and the same per-slot context and threads, in the
same rounds, one server at a time.

    python benchmarks/serve_parallel.py [--parallel 1,8] [--clients 8] [-n 64] [--rounds 3]
        [--threads 2] [--speculative MODE] [--peer-server LLAMA_SERVER]
        [--out benchmarks/results/serve_parallel.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions

TEXT = (
    "wrote a short story about a lighthouse keeper who finds a message in a bottle, and the "
    "story begins like this:"
)
BAN_EOS = {"0": -100, "2": -100}  # the default model's end-of-text and end-of-turn ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    model: str, parallel: int, threads: int, context: int, extra: tuple[str, ...] = ()
) -> tuple[Any, str, list[str]]:
    """``edgeinfer serve --parallel N`` answering /health: (process, base URL, its log)."""
    port = _free_port()
    argv = [sys.executable, "-m", "edgeinfer.cli", "serve", model, "--port", str(port),
            "--threads", str(threads), "--context-length", str(context),
            "--parallel", str(parallel), "--max-queue", "64", *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ})
    return _serving(proc, port)


def _serving(proc: Any, port: int) -> tuple[Any, str, list[str]]:
    """``proc`` once it answers /health on ``port``: (process, base URL, its log)."""
    import httpx

    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # a first ONNX transcode takes a while
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {''.join(log)[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


class Stream:
    """One streamed completion, stamped: sent, each token event, end."""

    def __init__(self, url: str, prompt: str, n: int) -> None:
        self.body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                     "logit_bias": BAN_EOS, "stream_options": {"include_usage": True}}  # fmt: skip
        self.url = url
        self.sent = 0.0
        self.stamps: list[float] = []
        self.tokens = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import httpx

        self.sent = time.perf_counter()
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    self.tokens = event["usage"]["completion_tokens"]
                elif event["choices"] and event["choices"][0]["text"]:
                    self.stamps.append(time.perf_counter())
                if self.stop.is_set():
                    break

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent

    @property
    def decode_tok_s(self) -> float:
        span = self.stamps[-1] - self.stamps[0]
        return (len(self.stamps) - 1) / span if span > 0 else 0.0


def _threads(streams: list[Stream]) -> list[threading.Thread]:
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for t in threads:
        t.start()
    return threads


def _prompt(tag: str) -> str:
    return f"[{tag}] Someone {TEXT}"


def _burst(url: str, clients: int, n: int, tag: str) -> dict[str, Any]:
    streams = [Stream(url, _prompt(f"{tag}c{i:02d}"), n) for i in range(clients)]
    t0 = time.perf_counter()
    for t in _threads(streams):
        t.join()
    wall = max(s.stamps[-1] for s in streams) - t0
    tokens = sum(s.tokens or len(s.stamps) for s in streams)  # usage, else one per event
    assert tokens == clients * n, [s.tokens or len(s.stamps) for s in streams]
    return {
        "aggregate_tok_s": tokens / wall,
        "ttft_s": sorted(s.ttft for s in streams),
        "per_stream_decode_tok_s": statistics.median(s.decode_tok_s for s in streams),
    }


def _join(url: str, clients: int, n: int, tag: str) -> dict[str, float]:
    """TTFT of a request alone on the idle server, then joining clients-1 running streams."""
    alone = Stream(url, _prompt(f"{tag}alone"), n)
    alone.run()
    running = [Stream(url, _prompt(f"{tag}r{i:02d}"), 100_000) for i in range(clients - 1)]
    threads = _threads(running)
    while any(len(s.stamps) < 4 for s in running):  # every one of them is decoding
        time.sleep(0.01)
    joined = Stream(url, _prompt(f"{tag}joins"), n)
    joined.run()
    for s in running:
        s.stop.set()  # the next token ends each: the client hangs up, its slot is freed
    for t in threads:
        t.join()
    return {"alone_ttft_s": alone.ttft, "joined_ttft_s": joined.ttft}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _report(runs: dict[int, list[dict[str, Any]]], joins: dict[int, list[dict[str, float]]]):
    out: dict[str, Any] = {}
    for p, rounds in runs.items():
        ttfts = [t for r in rounds for t in r["ttft_s"]]
        out[str(p)] = {
            "aggregate_tok_s": _summary([r["aggregate_tok_s"] for r in rounds]),
            "per_stream_decode_tok_s": _summary([r["per_stream_decode_tok_s"] for r in rounds]),
            "ttft_p50_s": _percentile(ttfts, 0.5),
            "ttft_p95_s": _percentile(ttfts, 0.95),
            "rounds": rounds,
        }
        if joins.get(p):
            ratios = [j["joined_ttft_s"] / j["alone_ttft_s"] for j in joins[p]]
            out[str(p)]["join"] = {
                "alone_ttft_s": _summary([j["alone_ttft_s"] for j in joins[p]]),
                "joined_ttft_s": _summary([j["joined_ttft_s"] for j in joins[p]]),
                "joined_over_alone": _summary(ratios),
                "rounds": joins[p],
            }
    return out


def _machine() -> dict[str, Any]:
    import edgeinfer

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "edgeinfer": getattr(edgeinfer, "__version__", "?"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", default="1,8")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument(
        "--peer-server",
        type=Path,
        metavar="LLAMA_SERVER",
        help="also serve the default model's GGUF with this llama-server binary (-np N), "
        "in the same rounds",
    )
    parser.add_argument(
        "--speculative",
        metavar="MODE",
        help="also run edgeinfer serve --speculative MODE (its requests' default), in the "
        "same rounds",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "serve_parallel.json"
    )
    args = parser.parse_args()
    from edgeinfer.files import catalog

    machine = _machine()
    cond = conditions.start(args.threads, args.rounds)
    levels = [int(p) for p in args.parallel.split(",")]
    servers = {
        ("edgeinfer", p): _start(catalog.DEFAULT_MODEL, p, args.threads, args.context_length)
        for p in levels
    }
    if args.speculative:
        extra = ("--speculative", args.speculative)
        for p in levels:
            servers[f"edgeinfer --speculative {args.speculative}", p] = _start(
                catalog.DEFAULT_MODEL, p, args.threads, args.context_length, extra
            )
    if args.peer_server:
        gguf = str(catalog.fetch(catalog.DEFAULT_MODEL))
        for p in levels:
            servers["llama-server", p] = _start_peer(args.peer_server, gguf, p, args)
    runs, first, joins = _rounds(servers, args)
    report = {
        "model": catalog.DEFAULT_MODEL,
        "clients": args.clients,
        "tokens_per_request": args.n,
        "threads": args.threads,
        "context_length_per_slot": args.context_length,
        "rounds": args.rounds,
        "machine": machine | {"loadavg_at_end": os.getloadavg()},
        "servers": {
            f"{name} {p}": [ln.strip() for ln in s[2] if "serving" in ln or "listening" in ln]
            for (name, p), s in servers.items()
        },
        "conditions": conditions.finish(cond),
    }
    for name in dict.fromkeys(name for name, _ in servers):
        key = "parallel" if name == "edgeinfer" else name
        mine = {p for n, p in servers if n == name}
        report[key] = _report({p: runs[name, p] for p in mine}, {p: joins[name, p] for p in mine})
        for p in mine:
            later = report[key][str(p)]["aggregate_tok_s"]["median"]
            burst = first[name, p]
            over = burst["aggregate_tok_s"] / later
            report[key][str(p)]["first_burst"] = {**burst, "over_later_median": over}
    conditions.write(args.out, report)
    _print(report, servers)
    return 0


Label = tuple[str, int]  # (which server, its --parallel / -np)


def _rounds(servers: dict[Label, Any], args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Round 0 (each server's first burst after its start), then ``args.rounds`` rounds,
    the servers in turn within each; the servers are stopped at the end."""
    runs: dict[Label, list[dict[str, Any]]] = {k: [] for k in servers}
    first: dict[Label, dict[str, Any]] = {}
    joins: dict[Label, list[dict[str, float]]] = {k: [] for k in servers}
    try:
        for r in range(args.rounds + 1):
            for i, ((name, p), (_, url, _)) in enumerate(servers.items()):
                tag = f"r{r}p{p}s{i}"
                burst = _burst(url, args.clients, args.n, tag)
                join = _join(url, args.clients, args.n, tag) if p > 1 else None
                if r == 0:
                    first[name, p] = burst
                else:
                    runs[name, p].append(burst)
                    if join:
                        joins[name, p].append(join)
                print(f"round {r} {name} {p}: {burst['aggregate_tok_s']:.1f} tok/s"
                      + (f", join {join}" if join else ""), file=sys.stderr)  # fmt: skip
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    return runs, first, joins


def _print(report: dict[str, Any], servers: dict[Label, Any]) -> None:
    for name, p in servers:
        row = report["parallel" if name == "edgeinfer" else name][str(p)]
        p50, p95 = row["ttft_p50_s"] * 1000, row["ttft_p95_s"] * 1000
        line = f"{name} {p}: {row['aggregate_tok_s']['median']:.1f} tok/s aggregate "
        line += f"(first burst {row['first_burst']['aggregate_tok_s']:.1f}), "
        line += f"TTFT p50 {p50:.0f} ms p95 {p95:.0f} ms"
        if "join" in row:
            line += f", joined/alone TTFT {row['join']['joined_over_alone']['median']:.2f}x"
        print(line)


def _start_peer(
    binary: Path, gguf: str, parallel: int, args: argparse.Namespace
) -> tuple[Any, str, list[str]]:
    """``llama-server -np N`` on the same GGUF, each slot the same context, answering /health."""
    port = _free_port()
    argv = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(parallel), "-c", str(parallel * args.context_length),
            "-t", str(args.threads), "-tb", str(args.threads)]  # fmt: skip
    return _serving(subprocess.Popen(argv, stderr=subprocess.PIPE, text=True), port)


if __name__ == "__main__":
    raise SystemExit(main())
