"""Is a sequence's greedy output in a batch the same as its output alone?

On both routes of the default catalog model (the GGUF file on llama.cpp, and its exact ONNX
transcode on onnxruntime), eight prompts of different lengths each generate 64 greedy
tokens (end of generation banned) alone on a model loaded with ``parallel=1`` (today's path:
the reference), then on a model loaded with ``parallel=8`` in batches of 1, 2, 4 and 8 run by
``model.generate_many`` (every prompt in exactly one batch of each size). For each batch size:
how many of the eight outputs equal the reference token for token, and where each differing
one first differs.

    python benchmarks/batch_exactness.py [-o benchmarks/results/batch_exactness.json]
        [--routes llama.cpp,onnxruntime] [--model NAME]

``--model`` takes another catalog model (its GGUF on llama.cpp, the catalog name on the
ONNX route), for example a Q4_K_M file, whose K-quant and repacked weights llama.cpp
computes with kernels that change with a batch's rows.

A difference means a kernel whose sums depend on the batch: matrix products whose blocking
or row grouping changes with the number of rows, attention over slots of other lengths, a
prompt prefilled in other chunks. Greedy decoding turns a last-bit difference into another
token only where the top two logits are nearly tied, so "identical" is a property of the
route and the model, measured here, not a promise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import edgeinfer
from edgeinfer.bench.workload import end_of_generation_ids, prompt_ids
from edgeinfer.files import catalog
from edgeinfer.machine.inventory import devices

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions

LENGTHS = (12, 37, 64, 91, 130, 171, 240, 333)  # tokens of the eight prompts
BATCHES = (1, 2, 4, 8)
NEW_TOKENS = 64
CONTEXT = 512
THREADS = 2
OUT = Path(__file__).parent / "results" / "batch_exactness.json"


def greedy(ban: list[int]) -> dict[str, Any]:
    return {
        "max_new_tokens": NEW_TOKENS,
        "temperature": 0,
        "logit_bias": {t: float("-inf") for t in ban},
    }


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a shorter one differs at its end),
    or None when they are the same."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def alone(target: str, options: dict[str, Any]) -> tuple[list[tuple[int, ...]], dict[str, Any]]:
    """Each prompt's tokens on a model with one slot (the reference), and its info."""
    with edgeinfer.load(target, parallel=1, **options) as model:
        ban = end_of_generation_ids(model)
        outs = []
        for i, n in enumerate(LENGTHS):
            ids = prompt_ids(model, n, variant=i)
            outs.append(model.generate(ids, **greedy(ban)).token_ids)
            print(f"  alone: prompt {i} ({n} tokens) done", file=sys.stderr)
        return outs, _info(model)


def batched(target: str, options: dict[str, Any]) -> tuple[dict[int, list], dict[str, Any]]:
    """Each prompt's tokens in batches of each size on a model with 8 slots."""
    outs: dict[int, list[tuple[int, ...]]] = {}
    with edgeinfer.load(target, parallel=max(BATCHES), **options) as model:
        ban = end_of_generation_ids(model)
        prompts = [prompt_ids(model, n, variant=i) for i, n in enumerate(LENGTHS)]
        for size in BATCHES:
            got: list[tuple[int, ...]] = []
            for start in range(0, len(prompts), size):
                group = [{"prompt": p} for p in prompts[start : start + size]]
                results = model.generate_many(group, **greedy(ban))
                got.extend(r.token_ids for r in results)
                print(
                    f"  batch of {size}: prompts {start}..{start + size - 1} done", file=sys.stderr
                )
            outs[size] = got
        return outs, _info(model)


def _info(model: Any) -> dict[str, Any]:
    info = model.info
    keep = ("provider", "device", "format", "context_length", "parallel", "route", "lone_steps")
    return {k: info.get(k) for k in keep}


def compare(reference: list[tuple[int, ...]], outs: dict[int, list]) -> dict[str, Any]:
    rows = {}
    for size, got in outs.items():
        firsts = [first_difference(r, g) for r, g in zip(reference, got, strict=True)]
        same = sum(1 for f in firsts if f is None)
        differing = [f for f in firsts if f is not None]
        rows[str(size)] = {
            "sequences": len(firsts),
            "identical": same,
            "fraction_identical": same / len(firsts),
            "first_difference": firsts,  # per prompt, in LENGTHS order; null = identical
            "earliest_difference": min(differing) if differing else None,
        }
    return rows


def measure(route: str, target: str, options: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    reference, info_alone = alone(target, options)
    outs, info_batched = batched(target, options)
    return {
        "route": route,
        "model": target,
        "load_options": options,
        "alone": info_alone,
        "batched": info_batched,
        "by_batch_size": compare(reference, outs),
        "seconds": time.perf_counter() - t0,
    }


def versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0]}
    for name in ("edgeinfer", "llama-cpp-python", "onnxruntime", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def earlier_results(path: Path, measured: set[str]) -> list[dict[str, Any]]:
    """The results of routes not measured now, from an earlier run's file (``--routes``
    measures one route at a time into the same file)."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [r for r in earlier.get("results", []) if r.get("route") not in measured]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    parser.add_argument("--routes", default="llama.cpp,onnxruntime", help="which routes to measure")
    parser.add_argument("--model", default=catalog.DEFAULT_MODEL, help="a catalog model's name")
    args = parser.parse_args()
    gguf = str(catalog.fetch(args.model))
    # token ids, not times, are measured: no wait for a quiet machine, but its load is kept
    cond = conditions.start(THREADS, 1, wait=False)
    base = {"context_length": CONTEXT, "threads": THREADS}
    targets = {
        "llama.cpp": (gguf, {**base, "engine": "llama.cpp"}),
        "onnxruntime": (args.model, {**base, "engine": "onnxruntime"}),
    }
    results = []
    for route in args.routes.split(","):
        target, options = targets[route]
        print(f"{route}: {target}", file=sys.stderr)
        result = measure(route, target, options)
        result["command"] = ["python", "benchmarks/batch_exactness.py", "--routes", route,
                             "--model", args.model]  # fmt: skip
        for size, row in result["by_batch_size"].items():
            same = f"{row['identical']}/{row['sequences']} identical"
            where = f"earliest difference at {row['earliest_difference']}"
            print(f"  batch {size}: {same}, {where}", file=sys.stderr)
        results.append(result)
    record = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["python", "benchmarks/batch_exactness.py", *sys.argv[1:]],
        "machine": {**devices().to_dict(), "platform": platform.platform()},
        "versions": versions(),
        "settings": {
            "prompt_lengths": list(LENGTHS),
            "batch_sizes": list(BATCHES),
            "new_tokens": NEW_TOKENS,
            "context_length": CONTEXT,
            "threads": THREADS,
            "sampling": "greedy, end of generation banned",
        },
        "results": results,
        "conditions": conditions.finish(cond),
    }
    kept = earlier_results(args.output, {r["route"] for r in results})
    record["results"] = kept + results
    conditions.write(args.output, record)
    print(f"written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
