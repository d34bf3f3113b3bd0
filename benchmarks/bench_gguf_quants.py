"""The README's GGUF quantization table: size and agreement of each llama.cpp quantization.

Quantizes the default model's f16 GGUF (written from its dequantized checkpoint by the test
fixtures, or any f16 GGUF given) with llama.cpp's quantizer through ``edgeinfer convert``,
validates each result against the f16 source as ``convert`` does (8 prompts x 16 tokens),
first at the default thresholds (to record whether it passes them), then, if it does not,
with the thresholds at 0 to record its figures anyway; then answers "The capital of France
is" greedily with edgeinfer and with llama-cpp-python on the result.

    python benchmarks/bench_gguf_quants.py [--f16 FILE] [--quants q8_0 q6_k q4_k_m]

Writes benchmarks/results/gguf_quants.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"


def default_f16() -> Path:
    from edgeinfer.files import catalog

    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    assert entry.sha256 is not None
    return catalog.edgeinfer_home() / "derived" / f"{entry.sha256[:16]}-r2/gguf/smollm2-f16.gguf"


def quantize(f16: Path, out: Path, quant: str, threads: int) -> dict[str, Any]:
    from edgeinfer.converters import convert
    from edgeinfer.errors import ConversionError

    row: dict[str, Any] = {"quant": quant}
    started = time.perf_counter()
    try:
        result = convert(f16, out, to="gguf", quant=quant, threads=threads, overwrite=True)
        row["passes_defaults"] = True
    except ConversionError as exc:
        row["passes_defaults"] = False
        row["refused_with"] = str(exc).splitlines()[0]
        result = convert(
            f16, out, to="gguf", quant=quant, threads=threads, overwrite=True,
            min_top1_agreement=0.0, min_greedy_agreement=0.0,
        )  # fmt: skip
    row["seconds"] = round(time.perf_counter() - started, 2)
    report = {k: v for k, v in result.report.items() if k != "per_prompt"}
    row.update(report=report, bytes=out.stat().st_size, size_mb=round(out.stat().st_size / 1e6))
    for key in ("top1_agreement", "greedy_agreement"):
        row[f"{key}_pct"] = round(100 * float(report[key]), 1)
    row["mean_kl"] = round(float(report["mean_kl"]), 4)
    row.update(answers(out, threads))
    return row


def answers(path: Path, threads: int) -> dict[str, Any]:
    import edgeinfer
    from edgeinfer.bench.peers import policy_llama

    with edgeinfer.load(path, context_length=256, threads=threads) as model:
        ours = model.generate(PROMPT, max_new_tokens=4, temperature=0)
    ref = policy_llama(str(path), n_ctx=256, n_threads=threads, verbose=False)
    try:
        theirs = ref.create_completion(PROMPT, max_tokens=4, temperature=0)["choices"][0]["text"]
    finally:
        ref.close()
    return {
        "edgeinfer_answer": ours.text,
        "llama_cpp_python_answer": theirs,
        "answers_paris": "Paris" in ours.text and "Paris" in theirs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--f16", type=Path, default=None, help="f16 GGUF (default: the tests' one)")
    ap.add_argument("--quants", nargs="*", default=["q8_0", "q6_k", "q4_k_m"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "gguf_quants.json"
    )
    args = ap.parse_args()
    f16 = args.f16 or default_f16()
    if not f16.is_file():
        print(f"no f16 GGUF at {f16}: run `pytest -m model tests/test_convert_gguf.py` "
              "once, or pass --f16", file=sys.stderr)  # fmt: skip
        return 2
    load_before = list(os.getloadavg())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for quant in args.quants:
            row = quantize(f16, Path(tmp) / f"m-{quant}.gguf", quant, args.threads)
            print(json.dumps({k: v for k, v in row.items() if k != "report"}), flush=True)
            rows.append(row)
    record = {
        "source": str(f16),
        "source_bytes": f16.stat().st_size,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
