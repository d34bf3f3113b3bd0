"""The kernels' own noise between a verify pass and one-token steps over the same tokens.

Speculative decoding keeps a draft when the sampler picks it from a verify pass's row; plain
decoding picks from a one-token step's. The two compute the same logits with other kernels,
so they agree only to the engine's noise, and greedy decoding can part where plain decoding's
top two tokens are closer than that noise. This measures it on the default model, per route,
over the benchmark's 50 requests (``speculative.tasks``, 10 per task): each prompt read, then
``--new-tokens`` greedy one-token steps; the cache rewound to the prompt and the same tokens
read again in passes of 9 (the pending token and 8 drafts, what ``lookup`` checks at most).
For every position it records the largest logit difference over the vocabulary, the step's
top-two margin, how far the pass moved that margin (the quantity a greedy choice turns on)
and whether the top token differs.

    python benchmarks/verify_noise.py [--new-tokens 32] [--threads 2]
        [-o benchmarks/results/verify_noise.json]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import conditions
import numpy as np
from speculative import ROUTES, tasks

import edgeinfer
from edgeinfer.files.catalog import DEFAULT_MODEL

RESULTS = Path(__file__).parent / "results" / "verify_noise.json"
PASS = 9  # tokens a verify pass reads: the pending one and up to 8 drafts


def _rows(backend: Any, ids: list[int], new_tokens: int) -> list[dict[str, Any]]:
    """One prompt: each new position's step row against its verify-pass row."""
    backend.rewind(0)
    steps = [np.array(backend.prefill(ids), np.float64)]
    tokens: list[int] = []
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(steps[-1])))
        steps.append(np.array(backend.decode(tokens[-1]), np.float64))
    backend.rewind(len(ids))
    passed: list[np.ndarray] = []
    for start in range(0, new_tokens, PASS):
        passed.extend(np.array(backend.forward(tokens[start : start + PASS]), np.float64))
    backend.rewind(0)
    rows = []
    for step, verify in zip(steps[1:], passed, strict=True):
        first, second = np.argsort(step)[-1], np.argsort(step)[-2]
        margin = step[first] - step[second]
        rows.append({
            "max_diff": float(np.max(np.abs(step - verify))),
            "margin": float(margin),
            "margin_moved": float(abs(margin - (verify[first] - verify[second]))),
            "top_differs": bool(int(np.argmax(verify)) != int(first)),
        })  # fmt: skip
    return rows


def measure(route: str, threads: int, new_tokens: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with edgeinfer.load(DEFAULT_MODEL, engine=ROUTES[route], threads=threads,
                        context_length=1024) as model:  # fmt: skip
        for requests in tasks().values():
            for request in requests:
                text = model.apply_chat_template(request["messages"])
                rows += _rows(model._backend, model.tokenize(text, add_special=False), new_tokens)
    flips = [r["margin"] for r in rows if r["top_differs"]]
    return {
        "route": route,
        "positions": len(rows),
        "max_diff": _spread([r["max_diff"] for r in rows]),
        "margin_moved": _spread([r["margin_moved"] for r in rows]),
        "top_token_differs": len(flips),
        "margins_where_it_differs": sorted(flips),
    }


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"median": statistics.median(ordered), "p99": p99, "max": ordered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    measured = conditions.start(args.threads, 1)
    routes = [measure(route, args.threads, args.new_tokens) for route in ROUTES]
    record = {
        "what": "a verify pass of 9 tokens against one-token steps over the same greedy tokens: "
        "the largest logit difference per position, how far it moved the step's top-two "
        "margin, and where the top token differs",
        "model": DEFAULT_MODEL,
        "requests": sum(len(r) for r in tasks().values()),
        "new_tokens": args.new_tokens,
        "routes": routes,
        "conditions": conditions.finish(measured),
    }
    conditions.write(args.output, record)
    for r in routes:
        print(f"{r['route']}: {r['positions']} positions, max logit difference "
              f"{r['max_diff']['max']:.3f} (p99 {r['max_diff']['p99']:.3f}), top-two margin moved "
              f"at most {r['margin_moved']['max']:.3f}; top token differs at "
              f"{r['top_token_differs']}")  # fmt: skip


if __name__ == "__main__":
    main()
