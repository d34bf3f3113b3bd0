"""One stream's speed through the one generation loop, beside an earlier edgeinfer's.

The engine's slot loop serves ``parallel=1`` too (one slot, stepped in the caller's thread),
where an earlier edgeinfer ran a loop of its own. This runs ``edgeinfer bench`` of both on the
same model, route and workload, interleaved round by round (baseline, this, baseline, this,
...; each run a fresh process as ``bench`` makes it), and reports each one's decode and
prefill tokens/s and this one's ratio to the baseline, per route.

The baseline is another interpreter with the earlier edgeinfer installed (a wheel built from
its commit, in a venv that sees this one's site-packages for the engines):

    git worktree add /tmp/base <commit>
    python -m venv /tmp/basevenv
    echo "$PWD/.venv/lib/python3.11/site-packages" \\
        > /tmp/basevenv/lib/python3.11/site-packages/engines.pth
    /tmp/basevenv/bin/pip install --no-deps /tmp/base
    python benchmarks/one_loop.py --baseline /tmp/basevenv/bin/python --baseline-commit <commit> \\
        --rounds 10 --threads 2 -o benchmarks/results/one_loop.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions
from bench_cli import edgeinfer_runs

ROUTES = {"gguf": "llama.cpp", "onnx": "onnxruntime"}

# The loop's own cost per token, without an engine: a backend whose forward pass is free
# (fixed logits, a Python list for the cache) under Model.generate, greedy, 4,000 tokens.
# Run by each side's interpreter, outside the checkout; prints microseconds per token.
OVERHEAD = """
import time, numpy as np
from pathlib import Path
from edgeinfer.model import Model

class Tok:
    n_vocab, bos_token, eos_token, chat_template = 512, None, None, None
    def encode(self, text, *, add_special=True, parse_special=True): return [1, 2, 3, 4]
    def token_bytes(self, t): return b"a"
    def is_end_of_generation(self, t): return False

class Free:
    tokenizer, n_ctx, reuse_is_exact, kv_nbytes, info = Tok(), 8192, True, 0, {"backend": "free"}
    def __init__(self):
        self.cache, self.logits = [], np.zeros(512, np.float32)
        self.logits[7] = 1.0
    @property
    def n_past(self): return len(self.cache)
    def prefill(self, ids): self.cache += list(ids); return self.logits
    def decode(self, t): self.cache.append(t); return self.logits
    def rewind(self, n): del self.cache[n:]
    def close(self): pass

model = Model(Free(), name="free", path=Path("free"), model_format="free")
model.generate("x", max_new_tokens=200, temperature=0)
start = time.perf_counter()
r = model.generate("x", max_new_tokens=4000, temperature=0)
print(1e6 * (time.perf_counter() - start) / len(r.token_ids))
"""


def bench_once(python: str, model: str, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``edgeinfer bench`` run (``--repetitions`` measured runs after one warm-up, each a
    fresh process): the medians of its runs."""
    options = [
        model, "--engine", engine, "-p", str(args.prompt_tokens), "-n", str(args.new_tokens),
        "-r", str(args.repetitions), "--warmup", "1", "--threads", str(args.threads),
    ]  # fmt: skip
    runs = edgeinfer_runs(options, timeout=args.timeout, python=python)
    return {
        "decode_tok_s": statistics.median(float(r["decode_tok_s"]) for r in runs),
        "prefill_tok_s": statistics.median(float(r["prefill_tok_s"]) for r in runs),
    }


def overhead_once(python: str) -> float:
    """The loop's microseconds per token on a free backend (``OVERHEAD``), by ``python``."""
    done = subprocess.run([python, "-c", OVERHEAD], capture_output=True, text=True,
                          timeout=300, cwd=tempfile.gettempdir())  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the overhead run of {python} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per route: each side's median figures over the rounds, and this one's ratio to the
    baseline's (the median of the per-round ratios, with their range)."""
    out: dict[str, Any] = {}
    for route in sorted({r["route"] for r in runs if r["route"] != "free"}):
        mine = [r for r in runs if r["route"] == route]
        rounds = sorted({r["round"] for r in mine})
        pairs = []
        for n in rounds:
            by_side = {r["side"]: r for r in mine if r["round"] == n}
            if {"baseline", "this"} <= set(by_side):
                pairs.append((by_side["baseline"], by_side["this"]))
        ratios = [b["decode_tok_s"] and t["decode_tok_s"] / b["decode_tok_s"] for b, t in pairs]
        out[route] = {
            "baseline_decode_tok_s": statistics.median(b["decode_tok_s"] for b, _ in pairs),
            "this_decode_tok_s": statistics.median(t["decode_tok_s"] for _, t in pairs),
            "baseline_prefill_tok_s": statistics.median(b["prefill_tok_s"] for b, _ in pairs),
            "this_prefill_tok_s": statistics.median(t["prefill_tok_s"] for _, t in pairs),
            "decode_ratio_median": statistics.median(ratios),
            "decode_ratio_range": [min(ratios), max(ratios)],
            "rounds": len(pairs),
        }
    free = [r for r in runs if r["route"] == "free"]
    if free:
        out["free"] = {
            side: {"us_per_token_median": statistics.median(
                r["us_per_token"] for r in free if r["side"] == side)}
            for side in ("baseline", "this")
        }  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="python with the earlier edgeinfer")
    parser.add_argument("--baseline-commit", default="", help="the commit it was built from")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--routes", default="gguf,onnx", help="of: " + ",".join(ROUTES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=3, help="measured runs per bench")
    parser.add_argument("-p", "--prompt-tokens", type=int, default=128)
    parser.add_argument("-n", "--new-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("-o", "--out", type=Path, default=Path("one_loop.json"))
    args = parser.parse_args(argv)
    routes = [r for r in args.routes.split(",") if r]
    if unknown := [r for r in routes if r not in ROUTES]:
        parser.error(f"unknown route(s) {unknown}; expected some of {', '.join(ROUTES)}")
    sides = {"baseline": args.baseline, "this": sys.executable}
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    cond = conditions.start(args.threads, args.rounds)
    runs: list[dict[str, Any]] = []
    for n in range(args.rounds):
        for route in routes:
            for side, python in sides.items():
                figures = bench_once(python, args.model, ROUTES[route], args)
                runs.append({"round": n, "route": route, "side": side, **figures})
                print(f"round {n} {route} {side}: {figures['decode_tok_s']:.1f} tok/s decode",
                      file=sys.stderr)  # fmt: skip
        for side, python in sides.items():
            runs.append({"round": n, "route": "free", "side": side,
                         "us_per_token": overhead_once(python)})  # fmt: skip
    result = {
        "conditions": conditions.finish(cond),
        "model": args.model,
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "repetitions_per_bench": args.repetitions,
        },
        "baseline": {"python": args.baseline, "commit": args.baseline_commit},
        "this": {"python": sys.executable, "commit": head.stdout.strip()},
        "summary": summarize(runs),
        "runs": runs,
    }
    conditions.write(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
