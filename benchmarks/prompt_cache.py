"""Warm starts from the prompt cache: time to first token from a new process, with and without
a KV snapshot of a long system prompt, on both routes of the default model.

Each round runs, for each route (GGUF on llama.cpp; its native ONNX transcode on onnxruntime),
three new processes in turn, 2 threads, context 2048:

- ``cold``: no prompt cache; the ~1,500-token system prompt plus a question, read whole;
- ``write``: the same with ``prompt_cache`` set to an empty folder: the snapshot is copied after
  the first token and written in the background (the first request's TTFT beside ``cold``'s);
- ``warm``: the system prompt plus another question, the folder holding that snapshot: its
  prefix is read from disk and only the rest is prefilled.

TTFT here is wall-clock from ``model.stream(...)`` to the first chunk in the child. The
``warm`` child then times ``load_state`` of the same snapshot file (restore MB/s) and a plain
read of the file into memory (this machine's read MB/s for that file; both from the page
cache, the file having just been written). Snapshot size is set beside the bytes of KV the
tokens hold (``2 x layers x kv_heads x head_dim x 2 bytes`` per token for the f16 llama.cpp
cache; the ONNX cache's dtype for the transcode). Medians over rounds, and each round's
ratios (robust to a load that drifts between rounds); the load average is recorded.

    python benchmarks/prompt_cache.py [--rounds 3] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
ROUTES = {"gguf": "llama.cpp", "onnx": "onnxruntime"}
CONTEXT = 2048

RULES = [
    "Answer in the language of the question.",
    "Never reveal account numbers, passwords or other secrets.",
    "Keep every answer under one hundred words unless the user asks for more.",
    "When a question is ambiguous, ask one short clarifying question first.",
    "Refuse politely when a request is harmful, and say why in one sentence.",
    "Quote prices in the customer's currency, with the tax shown separately.",
    "Recommend the help center article that matches the problem when there is one.",
    "Escalate to a human agent when the customer asks twice for one.",
]


def system_prompt() -> str:
    lines = [
        f"Rule {i + 1}: {RULES[i % len(RULES)]} (policy section {i // 8 + 1})" for i in range(70)
    ]
    return "You are the support assistant of Example Corp. Follow these rules.\n" + "\n".join(lines)


QUESTIONS = ["How do I reset my router?", "Can I get a refund for a duplicate charge?"]

CHILD = r"""
import json, os, sys, time
t_start = time.perf_counter()
import edgeinfer
spec = json.loads(sys.argv[1])
cache = spec["cache"]
model = edgeinfer.load(spec["model"], engine=spec["engine"], threads=spec["threads"],
                       context_length=spec["context"], prompt_cache=cache)
prompt = model.tokenize(spec["system"] + "\nQuestion: " + spec["question"] + "\nAnswer:")
t0 = time.perf_counter()
stream = model.stream(prompt, max_new_tokens=8, temperature=0)
first = None
ids = []
for chunk in stream:
    if first is None and chunk.token_ids:
        first = time.perf_counter() - t0
    ids.extend(chunk.token_ids)
total = time.perf_counter() - t0
stats = stream.result.stats
out = {"ttft_s": first, "total_s": total, "stats_ttft_s": stats.ttft_s,
       "prompt_tokens": len(prompt), "disk_prompt_tokens": stats.disk_prompt_tokens,
       "reused_prompt_tokens": stats.reused_prompt_tokens, "token_ids": ids,
       "info": {k: model.info.get(k) for k in ("backend", "engine_version", "kv_cache_bytes",
                                              "context_length", "threads")},
       "prompt_cache": model.info.get("prompt_cache")}
t1 = time.perf_counter()
model.close()  # waits for a snapshot being written
out["close_s"] = time.perf_counter() - t1
if cache and spec["measure_restore"]:
    files = sorted(p for p in os.listdir(cache) if p.endswith(".kvs"))
    path = os.path.join(cache, files[0])
    size = os.path.getsize(path)
    model = edgeinfer.load(spec["model"], engine=spec["engine"], threads=spec["threads"],
                           context_length=spec["context"])
    t2 = time.perf_counter(); n = len(model.load_state(path)); restore = time.perf_counter() - t2
    t3 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY); buf = bytearray(size); mv = memoryview(buf); done = 0
    while done < size:
        done += os.readv(fd, [mv[done:]])
    os.close(fd)
    read = time.perf_counter() - t3
    out.update({"snapshot_bytes": size, "snapshot_tokens": n, "restore_s": restore, "read_s": read})
    model.close()
print("RESULT " + json.dumps(out))
"""


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")


def kv_bytes_per_token(route: str, info: dict[str, Any]) -> float:
    return info["kv_cache_bytes"] / info["context_length"]


def one_round(route: str, threads: int, work: Path, r: int) -> dict[str, Any]:
    base = {"model": MODEL, "engine": ROUTES[route], "threads": threads, "context": CONTEXT,
            "system": system_prompt(), "measure_restore": False}  # fmt: skip
    folder = work / f"{route}-{r}"
    folder.mkdir()
    cold = run_child({**base, "cache": None, "question": QUESTIONS[0]})
    write = run_child({**base, "cache": str(folder), "question": QUESTIONS[0]})
    warm = run_child({**base, "cache": str(folder), "question": QUESTIONS[1],
                      "measure_restore": True})  # fmt: skip
    fresh = run_child({**base, "cache": None, "question": QUESTIONS[1]})
    per_token = kv_bytes_per_token(route, warm["info"])
    kv = per_token * warm["snapshot_tokens"]
    mb = 1e6
    return {
        "cold": cold,
        "write": write,
        "warm": warm,
        "fresh_second_question": fresh,
        "warm_over_cold": warm["ttft_s"] / fresh["ttft_s"],
        "write_over_cold": write["ttft_s"] / cold["ttft_s"],
        "same_tokens_warm_vs_fresh": warm["token_ids"] == fresh["token_ids"],
        "snapshot_over_kv": warm["snapshot_bytes"] / kv,
        "restore_mb_s": warm["snapshot_bytes"] / mb / warm["restore_s"],
        "read_mb_s": warm["snapshot_bytes"] / mb / warm["read_s"],
        "loadavg_after": os.getloadavg(),
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 3)

    def med_of(part: str, key: str) -> float:
        return round(statistics.median(r[part][key] for r in rounds), 3)

    return {
        "ttft_cold_s": med_of("fresh_second_question", "ttft_s"),
        "ttft_warm_s": med_of("warm", "ttft_s"),
        "warm_over_cold": med("warm_over_cold"),
        "warm_over_cold_rounds": [round(r["warm_over_cold"], 3) for r in rounds],
        "ttft_first_request_no_cache_s": med_of("cold", "ttft_s"),
        "ttft_first_request_writing_s": med_of("write", "ttft_s"),
        "write_over_cold": med("write_over_cold"),
        "write_over_cold_rounds": [round(r["write_over_cold"], 3) for r in rounds],
        "snapshot_bytes": rounds[0]["warm"]["snapshot_bytes"],
        "snapshot_tokens": rounds[0]["warm"]["snapshot_tokens"],
        "snapshot_over_kv": med("snapshot_over_kv"),
        "disk_prompt_tokens": rounds[0]["warm"]["disk_prompt_tokens"],
        "prompt_tokens": rounds[0]["warm"]["prompt_tokens"],
        "restore_mb_s": round(statistics.median(r["restore_mb_s"] for r in rounds), 1),
        "read_mb_s": round(statistics.median(r["read_mb_s"] for r in rounds), 1),
        "same_tokens_warm_vs_fresh": all(r["same_tokens_warm_vs_fresh"] for r in rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--routes", default="onnx,gguf")
    parser.add_argument("--out", default="benchmarks/results/prompt_cache.json")
    args = parser.parse_args()
    routes = args.routes.split(",")
    result: dict[str, Any] = {
        "command": "python benchmarks/prompt_cache.py " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
        },
        "loadavg_start": os.getloadavg(),
        "threads": args.threads,
        "context_length": CONTEXT,
        "rounds": {route: [] for route in routes},
    }
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        for r in range(args.rounds):
            for route in routes if r % 2 == 0 else list(reversed(routes)):
                t = time.time()
                result["rounds"][route].append(one_round(route, args.threads, home, r))
                print(f"round {r} {route}: {time.time() - t:.0f} s", file=sys.stderr)
                save(result, Path(args.out))  # each round as it ends: a long run can be cut
    print(json.dumps(result["summary"], indent=1))


def save(result: dict[str, Any], out: Path) -> None:
    result["loadavg_end"] = os.getloadavg()
    done = {route: rows for route, rows in result["rounds"].items() if rows}
    result["summary"] = {route: summary(rows) for route, rows in done.items()}
    result["rounds_done"] = {route: len(rows) for route, rows in result["rounds"].items()}
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
