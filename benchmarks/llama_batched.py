"""edgeinfer's llama.cpp route at N streams beside llama.cpp's own ``llama-batched-bench``.

The same GGUF (the default model's, kept on llama.cpp as a ``.gguf`` path is), the same
prompt and generation lengths, N sequences, the same threads and flash attention off
(edgeinfer's default, set on both); the rounds alternate the two, each a fresh process. The
figure compared is the decode rate while all N sequences decode: llama-batched-bench's
``speed_tg`` (N x tg tokens over its generation phase) and ``edgeinfer bench --parallel N``'s
``steady_decode_tok_s`` (tokens over the steps where every stream decodes).

    python benchmarks/llama_batched.py --batched-bench PATH [--parallel 8] [--rounds 4]
        [-o benchmarks/results/llama_batched.json]

``PATH`` is llama-batched-bench built from the llama.cpp source that llama-cpp-python
vendors (``python benchmarks/llama_cpp_speculative.py --build-only`` unpacks and builds it;
``cmake --build BUILD --target llama-batched-bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions

from edgeinfer.files import catalog


def peer_once(binary: Path, gguf: str, args: argparse.Namespace) -> dict[str, float]:
    """One llama-batched-bench run: its generation and prompt rates (tokens/s)."""
    kv = args.parallel * (args.prompt_tokens + args.new_tokens)
    command = [str(binary), "-m", gguf, "-c", str(kv), "-npp", str(args.prompt_tokens),
               "-ntg", str(args.new_tokens), "-npl", str(args.parallel), "-t", str(args.threads),
               "-tb", str(args.threads), "-fa", "off", "--output-format", "jsonl"]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line) for line in done.stdout.splitlines() if '"speed_tg"' in line]
    if done.returncode != 0 or len(rows) != 1:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return {"decode_tok_s": float(rows[0]["speed_tg"]), "prefill_tok_s": float(rows[0]["speed_pp"])}


def edgeinfer_once(gguf: str, args: argparse.Namespace) -> dict[str, float]:
    """One ``edgeinfer bench GGUF --parallel N`` run: the rate while every stream decodes."""
    command = [sys.executable, "-m", "edgeinfer", "bench", gguf, "--parallel", str(args.parallel),
               "-p", str(args.prompt_tokens), "-n", str(args.new_tokens), "-r", "1",
               "--warmup", "1", "--threads", str(args.threads), "--json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          cwd=tempfile.gettempdir())  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    (row,) = [r for r in json.loads(done.stdout)["results"] if r.get("engine") == "edgeinfer"]
    (run,) = row["runs"]
    assert row["provider"].startswith("llama.cpp"), row["provider"]
    return {"decode_tok_s": float(run["steady_decode_tok_s"]),
            "prefill_tok_s": float(run["prefill_tok_s"])}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batched-bench", type=Path, required=True, metavar="PATH")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=128)
    parser.add_argument("-n", "--new-tokens", type=int, default=64)
    parser.add_argument("-o", "--out", type=Path, default=Path("llama_batched.json"))
    args = parser.parse_args()
    gguf = str(catalog.fetch(catalog.DEFAULT_MODEL))
    cond = conditions.start(args.threads, args.rounds)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = ("edgeinfer", "llama-batched-bench")
        for who in order if r % 2 == 0 else order[::-1]:
            got = (
                edgeinfer_once(gguf, args)
                if who == "edgeinfer"
                else peer_once(args.batched_bench, gguf, args)
            )
            runs.append({"round": r, "who": who, **got})
            print(f"round {r} {who}: {got['decode_tok_s']:.1f} tok/s decoding", file=sys.stderr)
    record = {
        "model": catalog.DEFAULT_MODEL,
        "gguf": Path(gguf).name,
        "workload": {k: getattr(args, k) for k in ("parallel", "prompt_tokens", "new_tokens")},
        "flash_attention": "off on both",
        "summary": _summary(runs, args.rounds),
        "runs": runs,
        "conditions": conditions.finish(cond),
    }
    conditions.write(args.out, record)
    print(json.dumps(record["summary"], indent=1))
    return 0


def _summary(runs: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    def rate(r: int, who: str) -> float:
        return next(x["decode_tok_s"] for x in runs if x["round"] == r and x["who"] == who)

    ratios = [rate(r, "edgeinfer") / rate(r, "llama-batched-bench") for r in range(rounds)]
    return {
        who: {"decode_tok_s_median": statistics.median(rate(r, who) for r in range(rounds))}
        for who in ("edgeinfer", "llama-batched-bench")
    } | {"ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}


if __name__ == "__main__":
    raise SystemExit(main())
