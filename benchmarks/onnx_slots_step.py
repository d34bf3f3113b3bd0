"""Sequence slots on the ONNX route: what one batched step (``decode_many``) buys, and whether a
sequence decoded in a batch picks the tokens it picks alone.

The default model's native transcode (its GGUF blocks kept, MatMulNBits with int8 activations)
is opened by the ONNX backend with 8 slots, 2 threads, context 1024. Eight prompts of
different lengths (7 to 90 tokens) are prefilled into slots 0..k-1, then:

- throughput: 48 greedy ``decode_many`` steps over k = 1, 2, 4, 8 slots, aggregate tokens/s;
  the k values interleaved in each round (rotated), 5 rounds, each round's figures relative to
  its own k = 1; a one-slot backend's ``decode`` loop in the same rounds for reference;
- exactness: each composition of k slots decodes 32 greedy tokens per slot; each slot's
  tokens against the same prompt decoded alone in a one-slot backend (equal sequences, tokens
  before the first divergence), the first step's logits against alone (max |difference|), and
  against the same slot in the k = 8 batch (whether rows of different batch sizes agree bit
  for bit).

    python benchmarks/onnx_slots_step.py [--threads 2] [--rounds 5] [--out FILE.json]

Writes benchmarks/results/onnx_slots_step.json. The machine is shared: the load average
before and after is recorded with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

_KS = (1, 2, 4, 8)
_LENGTHS = (12, 40, 23, 64, 7, 90, 31, 50)
_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe. Workshops in Mainz, Venice and "
    "Paris printed bibles, grammars and calendars; within fifty years millions of copies were "
    "in circulation, and scholars could compare the same page in distant cities. Prices fell, "
    "literacy rose, and new kinds of writing appeared: pamphlets, newspapers, scientific "
    "journals. The same story repeats with every technology that makes copying cheap."
)


def _open(folder: Path, parallel: int, threads: int) -> Any:
    from edgeinfer.config import LoadConfig
    from edgeinfer.files.manifest import Manifest
    from edgeinfer.machine.policy import Candidate
    from edgeinfer.runtimes.onnxruntime import open_backend

    config = LoadConfig(context_length=1024, threads=threads, parallel=parallel)
    cpu = Candidate("CPUExecutionProvider", "cpu", "benchmark")
    return open_backend(folder, config, Manifest.read(folder), cpu)


def _fill(backend: Any, prompts: list[list[int]], k: int) -> list[int]:
    """Prompts 0..k-1 prefilled into slots 0..k-1; each slot's greedy first token."""
    first = []
    for slot in range(k):
        backend.rewind(0, slot)
        first.append(int(np.argmax(backend.prefill(prompts[slot], slot))))
    return first


def _steps_rate(backend: Any, prompts: list[list[int]], k: int, steps: int) -> float:
    tokens = _fill(backend, prompts, k)
    start = time.perf_counter()
    for _ in range(steps):
        out = backend.decode_many([(s, tokens[s]) for s in range(k)])
        tokens = [int(t) for t in out.argmax(axis=1)]
    return k * steps / (time.perf_counter() - start)


def _alone_rate(one: Any, prompt: list[int], steps: int) -> float:
    one.rewind(0)
    token = int(np.argmax(one.prefill(prompt)))
    start = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(one.decode(token)))
    return steps / (time.perf_counter() - start)


def throughput(many: Any, one: Any, prompts: list[list[int]], rounds: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {str(k): [] for k in _KS}
    rates["alone"] = []
    ratios: dict[str, list[float]] = {str(k): [] for k in _KS}
    _steps_rate(many, prompts, 8, 8)  # warm-up
    for r in range(rounds):
        order = list(_KS[r % len(_KS) :] + _KS[: r % len(_KS)])
        got = {k: _steps_rate(many, prompts, k, 48) for k in order}
        rates["alone"].append(_alone_rate(one, prompts[0], 48))
        for k in _KS:
            rates[str(k)].append(got[k])
            ratios[str(k)].append(got[k] / got[1])
    return {
        "aggregate_tok_s": {k: _spread(v) for k, v in rates.items()},
        "relative_to_k1": {k: _spread(v, 2) for k, v in ratios.items()},
    }


def _spread(values: list[float], digits: int = 1) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits + 1) for v in values],
    }


def _greedy_alone(one: Any, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    one.rewind(0)
    logits = one.prefill(prompt)
    tokens = [int(np.argmax(logits))]
    first = None
    for _ in range(n - 1):
        logits = one.decode(tokens[-1])
        first = logits.copy() if first is None else first
        tokens.append(int(np.argmax(logits)))
    assert first is not None
    return tokens, first


def _greedy_batch(many: Any, prompts: list[list[int]], k: int, n: int) -> Any:
    tokens = [[t] for t in _fill(many, prompts, k)]
    first = None
    for _ in range(n - 1):
        out = many.decode_many([(s, tokens[s][-1]) for s in range(k)])
        first = out.copy() if first is None else first
        for s in range(k):
            tokens[s].append(int(np.argmax(out[s])))
    return tokens, first


def exactness(many: Any, one: Any, prompts: list[list[int]], n: int = 32) -> dict[str, Any]:
    alone = [_greedy_alone(one, p, n) for p in prompts]
    batches = {k: _greedy_batch(many, prompts, k, n) for k in _KS}
    rows: dict[str, Any] = {}
    for k in _KS:
        tokens, first = batches[k]
        prefixes = [_prefix(tokens[s], alone[s][0]) for s in range(k)]
        rows[str(k)] = {
            "sequences_equal": sum(p == n for p in prefixes),
            "sequences": k,
            "tokens_before_divergence": prefixes,
            "first_step_max_abs_diff_vs_alone": float(
                max(np.abs(first[s] - alone[s][1]).max() for s in range(k))
            ),
            "first_step_rows_equal_k8_rows": bool(
                all(np.array_equal(first[s], batches[8][1][s]) for s in range(k))
            ),
        }
    return {"greedy_tokens_per_sequence": n, "by_k": rows}


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "onnx_slots_step.json"
    )
    args = parser.parse_args()
    import onnxruntime

    from edgeinfer.files import catalog
    from edgeinfer.files.source import resolve
    from edgeinfer.loader import transcoded_catalog_model

    folder = transcoded_catalog_model(resolve(catalog.DEFAULT_MODEL)).path
    many = _open(folder, 8, args.threads)
    one = _open(folder, 1, args.threads)
    ids = many.tokenizer.encode(_TEXT * 2, add_special=False)
    prompts = [ids[i : i + n] for i, n in enumerate(_LENGTHS)]
    load_before = os.getloadavg()
    speed = throughput(many, one, prompts, args.rounds)
    exact = exactness(many, one, prompts)
    result = {
        "benchmark": "onnx_slots_step",
        "model": catalog.DEFAULT_MODEL,
        "folder": folder.name,
        "threads": args.threads,
        "context": 1024,
        "prompt_lengths": list(_LENGTHS),
        "machine": {
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "onnxruntime": onnxruntime.__version__,
        "throughput": speed,
        "exactness": exact,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"throughput": speed["relative_to_k1"], "exactness": exact}, indent=1))


if __name__ == "__main__":
    main()
