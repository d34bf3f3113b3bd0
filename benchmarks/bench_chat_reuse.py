"""Prompt reuse in a chat: time to first token of turn 4, reused cache vs an empty one.

A 4-turn conversation on the default model at temperature 0. Turn 4 is answered twice:
by the model that served turns 1-3 (its KV cache holds the conversation, so only the new
turn is read) and by a freshly loaded model that reads the whole conversation. The script
prints both times to first token, their ratio, and whether the two replies are identical.
Each run answers turn 4 both ways, one after the other (A/B per run, medians over runs); the
load average before and after each run is recorded beside it, since the machine may be
shared.

    python benchmarks/bench_chat_reuse.py [--model smollm2-135m-instruct] [--runs 3]
        [--engine llama.cpp] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import edgeinfer

SYSTEM = (
    "You are a patient geography teacher. Answer in two or three sentences, with one "
    "concrete example, and end every answer with a short question for the student."
)
QUESTIONS = [
    "Why do most big cities lie next to rivers or on a coast? Think about trade, water and "
    "food, and tell me which of these mattered most in history.",
    "Which mountain ranges shaped the borders between countries in Europe, and how did they "
    "change the languages people speak on either side?",
    "What is the difference between weather and climate, and why can a cold winter happen in "
    "a world that is getting warmer on average?",
    "If I travel from the equator to the North Pole, which kinds of landscape and vegetation "
    "will I see on the way, in order?",
]
REPLY_TOKENS = 64


def conversation(model: edgeinfer.Model) -> tuple[list[dict[str, str]], Any]:
    """Turns 1-3 on ``model``; returns the messages for turn 4 and turn 3's result."""
    messages = [{"role": "system", "content": SYSTEM}]
    result = None
    for question in QUESTIONS[:3]:
        messages.append({"role": "user", "content": question})
        result = model.chat(messages, max_new_tokens=REPLY_TOKENS, temperature=0)
        messages.append({"role": "assistant", "content": result.text})
    messages.append({"role": "user", "content": QUESTIONS[3]})
    return messages, result


def one_run(path: str, threads: int, **load: Any) -> dict[str, Any]:
    load_before = os.getloadavg()
    with edgeinfer.load(path, threads=threads, context_length=2048, **load) as model:
        messages, _ = conversation(model)
        reused = model.chat(messages, max_new_tokens=REPLY_TOKENS, temperature=0)
        backend = model.info.get("backend")
    with edgeinfer.load(path, threads=threads, context_length=2048, **load) as fresh:
        full = fresh.chat(messages, max_new_tokens=REPLY_TOKENS, temperature=0)
    return {
        "backend": backend,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "ratio": reused.stats.ttft_s / full.stats.ttft_s,
        "prompt_tokens": reused.stats.prompt_tokens,
        "reused_prompt_tokens": reused.stats.reused_prompt_tokens,
        "ttft_reused_s": reused.stats.ttft_s,
        "ttft_fresh_s": full.stats.ttft_s,
        "identical_reply": reused.token_ids == full.token_ids,
        "reply": reused.text,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attention", action="store_true")
    ap.add_argument(
        "--engine", default="auto", help="load(engine=...): auto, or llama.cpp for the GGUF route"
    )
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "chat_reuse.json"
    )
    args = ap.parse_args()
    load: dict[str, Any] = {"flash_attention": True} if args.flash_attention else {}
    if args.engine != "auto":
        load["engine"] = args.engine
    runs = [one_run(args.model, args.threads, **load) for _ in range(args.runs)]
    reused = statistics.median(r["ttft_reused_s"] for r in runs)
    fresh = statistics.median(r["ttft_fresh_s"] for r in runs)
    identical = all(r["identical_reply"] for r in runs)
    first = runs[0]
    print(f"turn 4 prompt: {first['prompt_tokens']} tokens, {first['reused_prompt_tokens']} reused")
    print(f"time to first token, reused cache: {reused * 1000:.1f} ms (median of {args.runs})")
    print(f"time to first token, empty cache:  {fresh * 1000:.1f} ms")
    print(f"ratio: {reused / fresh:.1%}   replies identical: {identical}")
    print(f"load average (1 min) over the runs: {[r['loadavg_before'][0] for r in runs]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "model": args.model,
        "threads": args.threads,
        "engine": args.engine,
        "flash_attention": args.flash_attention,
        "cpu_count": os.cpu_count(),
        "ratio": reused / fresh,
        "ratio_median_of_runs": statistics.median(r["ratio"] for r in runs),
        "ttft_reused_median_s": reused,
        "ttft_fresh_median_s": fresh,
        "identical": identical,
        "runs": runs,
    }
    args.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
