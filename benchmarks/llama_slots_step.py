"""What one llama.cpp forward pass over k sequences buys, through the backend's slots.

On the default model (Q4_1 GGUF), 2 threads (--threads), each run in a process of its own:

- step: a backend with 8 slots, each holding a different prompt (40-90 tokens); rounds of
  ``decode_many`` over slots 0..k-1 for k = 1, 2, 4, 8 (k interleaved within a round, the
  slots rewound after each); aggregate tokens/s = k / median step time, against k = 1.
- exact: each prompt decoded greedily alone in a one-slot backend, then k prompts stepped
  together with ``decode_many`` (slots of different lengths): how many sequences keep the
  alone run's greedy tokens, and the largest logit difference.
- single: plain ``decode`` at parallel=1 with this checkout's backend and with the backend
  of ``--before REV`` (git), alternating: the one-stream cost of the slots.

Variants: flash attention off/on, KV streams per sequence (default) or unified.

    python benchmarks/llama_slots_step.py [--rounds 3] [--threads 2] [--before REV] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
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

import numpy as np

KS = (1, 2, 4, 8)
THREADS = int(os.environ.get("EDGEINFER_BENCH_THREADS", "2"))
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who had "
    "never once in his long life seen the mountains beyond the valley. One morning he",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "Water boils at a temperature of one hundred degrees Celsius at sea level, but on a mountain",
    "List three primary colors and explain why they are called primary:",
    "In 1492, Columbus sailed across the Atlantic Ocean. His ships were called",
    "The quick brown fox jumps over the lazy dog. This sentence is famous because",
    "Question: What is the largest planet in our solar system?\nAnswer:",
]


def _backend(path: Path, parallel: int, *, fa: bool, unified: bool, module: Any = None) -> Any:
    from edgeinfer.config import LoadConfig
    from edgeinfer.files.gguf_file import read_gguf_header
    from edgeinfer.machine.inventory import devices
    from edgeinfer.machine.policy import plan_providers

    if module is None:
        from edgeinfer.runtimes import llama_cpp as module
    cpu = plan_providers(devices(), "gguf", "cpu").candidates[0]
    cpu = dataclasses.replace(cpu, options={**cpu.options, "kv_unified": unified})
    config = LoadConfig(context_length=1024, threads=THREADS, parallel=parallel, flash_attention=fa)
    return module.open_backend(path, config, read_gguf_header(path), cpu)


def _step(path: Path, rounds: int, steps: int, fa: bool, unified: bool) -> dict[str, Any]:
    """Median decode_many step time per k, each round interleaving the k values."""
    backend = _backend(path, 8, fa=fa, unified=unified)
    lengths = [backend.slot_past(s) for s in range(8)]
    for s, text in enumerate(PROMPTS):
        backend.prefill(backend.tokenizer.encode(text), s)
        lengths[s] = backend.slot_past(s)
    times: dict[int, list[float]] = {k: [] for k in KS}
    for _ in range(rounds):
        for k in KS:
            backend.decode_many([(s, 1) for s in range(k)])  # warm-up step
            stamps = [time.perf_counter()]
            for i in range(steps):
                backend.decode_many([(s, 100 + i) for s in range(k)])
                stamps.append(time.perf_counter())
            times[k].append(statistics.median(np.diff(stamps)))
            for s in range(k):
                backend.rewind(lengths[s], s)
    backend.close()
    tok_s = {k: [k / t for t in times[k]] for k in KS}
    base = statistics.median(tok_s[1])
    return {
        "prompt_tokens": lengths,
        "step_ms_median": {k: 1e3 * statistics.median(times[k]) for k in KS},
        "tok_s_per_round": tok_s,
        "tok_s_median": {k: statistics.median(tok_s[k]) for k in KS},
        "speedup_vs_k1": {k: statistics.median(tok_s[k]) / base for k in KS},
    }


def _alone(path: Path, n_new: int, fa: bool) -> list[tuple[list[int], np.ndarray]]:
    backend = _backend(path, 1, fa=fa, unified=False)
    runs = []
    for text in PROMPTS:
        backend.rewind(0)
        logits = [backend.prefill(backend.tokenizer.encode(text)).copy()]
        tokens: list[int] = []
        for _ in range(n_new):
            tokens.append(int(np.argmax(logits[-1])))
            logits.append(backend.decode(tokens[-1]).copy())
        runs.append((tokens, np.array(logits[:-1])))
    backend.close()
    return runs


def _exact(path: Path, n_new: int, fa: bool, unified: bool) -> dict[str, Any]:
    """Per k: sequences whose greedy tokens equal the alone run's, and the max logit gap."""
    alone = _alone(path, n_new, fa)
    out: dict[str, Any] = {}
    for k in KS:
        backend = _backend(path, 8, fa=fa, unified=unified)
        logits = {
            s: [backend.prefill(backend.tokenizer.encode(PROMPTS[s]), s).copy()] for s in range(k)
        }
        tokens: dict[int, list[int]] = {s: [] for s in range(k)}
        for _ in range(n_new - 1):
            steps = [(s, int(np.argmax(logits[s][-1]))) for s in range(k)]
            for s, t in steps:
                tokens[s].append(t)
            rows = backend.decode_many(steps)
            for s in range(k):
                logits[s].append(rows[s].copy())
        backend.close()
        equal = sum(tokens[s] + [int(np.argmax(logits[s][-1]))] == alone[s][0] for s in range(k))
        gap = max(float(np.abs(np.array(logits[s]) - alone[s][1]).max()) for s in range(k))
        out[str(k)] = {"sequences": k, "greedy_equal": equal, "max_logit_diff": gap}
    return out


def _single(path: Path, source: str | None, n: int) -> dict[str, Any]:
    """Plain decode at parallel=1 (128-token prompt, n greedy tokens): tokens/s."""
    module = None
    if source is not None:
        spec = importlib.util.spec_from_file_location("edgeinfer.runtimes._llama_before", source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    backend = _backend(path, 1, fa=False, unified=False, module=module)
    ids = (backend.tokenizer.encode(" ".join(PROMPTS)) * 4)[:128]
    logits = backend.prefill(ids)
    stamps = []
    for _ in range(n):
        logits = backend.decode(int(np.argmax(logits)))
        stamps.append(time.perf_counter())
    overhead = _python_us_per_decode(backend)
    backend.close()
    return {"decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]), "python_us_per_decode": overhead}


class _NoCompute:
    """The engine module with ``llama_decode`` doing nothing: what is left of ``decode`` is
    the backend's own Python work (CPU time, so a busy machine's waits do not count)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        return 0


def _python_us_per_decode(backend: Any, calls: int = 20000) -> float:
    real = backend._llama
    backend._llama = _NoCompute(real)
    backend.rewind(0)
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for i in range(calls):
            backend.decode(7)
            if i % 500 == 499:
                backend.rewind(0)
        best = min(best, (time.process_time() - start) / calls * 1e6)
    backend._llama = real
    return best


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    path = Path(job["path"])
    if job["kind"] == "step":
        return _step(path, job["rounds"], job["steps"], job["fa"], job["unified"])
    if job["kind"] == "exact":
        return _exact(path, job["n_new"], job["fa"], job["unified"])
    return _single(path, job.get("source"), job["n"])


def _run(job: dict[str, Any]) -> dict[str, Any]:
    load = os.getloadavg()[0]
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(job["kind"], {k: v for k, v in job.items() if k in ("fa", "unified", "source")},
          file=sys.stderr, flush=True)  # fmt: skip
    return {**job, "load_avg_before": load, "load_avg_after": os.getloadavg()[0], **result}


def _before_source(rev: str, folder: Path) -> str:
    text = subprocess.run(
        ["git", "show", f"{rev}:runtimes/llama_cpp.py"],
        check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
    ).stdout  # fmt: skip
    out = folder / "llama_cpp_before.py"
    out.write_text(text)
    return str(out)


def _singles(path: Path, rev: str, rounds: int, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        before = _before_source(rev, Path(folder))
        runs: dict[str, list[float]] = {"before": [], "after": []}
        python_us: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(rounds):
            for name, source in (("before", before), ("after", None)):
                job = {"kind": "single", "path": str(path), "source": source, "n": n}
                done = _run(job)
                runs[name].append(done["decode_tok_s"])
                python_us[name].append(done["python_us_per_decode"])
    med = {name: statistics.median(v) for name, v in runs.items()}
    us = {name: min(v) for name, v in python_us.items()}
    return {
        "before_rev": rev,
        "decode_tok_s": runs,
        "median": med,
        "after_vs_before": med["after"] / med["before"],
        "python_us_per_decode": python_us,
        "python_us_added_per_token": us["after"] - us["before"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--n-new", type=int, default=24, help="greedy tokens per exactness run")
    parser.add_argument("--n-single", type=int, default=64, help="tokens per one-stream run")
    parser.add_argument("--before", default="e4aa201", help="git revision of the old backend")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--single-only", action="store_true", help="re-measure the one-stream part into --out"
    )
    parser.add_argument("--out", default="benchmarks/results/llama_slots_step.json")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    from edgeinfer.files import catalog

    os.environ["EDGEINFER_BENCH_THREADS"] = str(args.threads)  # for the workers

    path = catalog.fetch(catalog.DEFAULT_MODEL)
    variants = [(False, False), (True, False), (False, True), (True, True)]
    if args.single_only:
        record = json.loads(Path(args.out).read_text())
        record["single"] = _singles(path, args.before, args.rounds, args.n_single)
        record["single"]["measured"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record["single"]))
        return
    record: dict[str, Any] = {
        "model": catalog.DEFAULT_MODEL,
        "file": path.name,
        "threads": args.threads,
        "context_per_slot": 1024,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "single": _singles(path, args.before, args.rounds, args.n_single),
        "variants": [],
    }
    for fa, unified in variants:
        base = {"path": str(path), "fa": fa, "unified": unified}
        step = _run({**base, "kind": "step", "rounds": args.rounds, "steps": args.steps})
        exact = _run({**base, "kind": "exact", "n_new": args.n_new})
        record["variants"].append({"flash_attention": fa, "kv_unified": unified,
                                   "step": step, "exact": exact})  # fmt: skip
        print(json.dumps({"fa": fa, "unified": unified, **step["speedup_vs_k1"]}), flush=True)
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["single"]["median"]), record["single"]["after_vs_before"])


if __name__ == "__main__":
    main()
