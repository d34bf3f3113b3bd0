"""Many streams at once on the default model: ``edgeinfer bench --parallel 1,2,4,8`` on its
two routes, beside onnxruntime-genai's continuous-batching ``og.Engine``, and the issue's
targets read from the figures.

    python benchmarks/bench_parallel.py [--genai-folder DIR] [-r 5] [-o FILE]

Runs, one after the other (each is ``edgeinfer bench``: a fresh process per run, engines
interleaved, warm-up first):

1. the catalog model on its ONNX route (``--engine onnxruntime``: the exact transcode of the
   GGUF's blocks), with ``--compare --peer-model GENAI_FOLDER``: og.Engine on the int4 CPU
   folder onnxruntime-genai's own builder made from the same checkpoint;
2. the GGUF file on llama.cpp (``--engine llama.cpp``).

Writes ``benchmarks/results/bench-parallel.json``: both reports whole (``edgeinfer bench
--from`` prints them again) and ``targets``: aggregate decode with 8 streams over one stream
on each route, edgeinfer over og.Engine at each parallelism (aggregate decode from the first
first token to the last token, and start to end: every token over the time from the requests
to the last token), and the TTFT of a request joining 7 running streams over its TTFT alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions

from edgeinfer.files import catalog

OUT = Path(__file__).parent / "results" / "bench-parallel.json"
PARALLEL = "1,2,4,8"


def default_genai_folder() -> Path:
    """Where the tests keep the default model's conversions; the genai folder beside them
    (``python -m onnxruntime_genai.models.builder -i $D/hf -o $D/ortgenai-int4-cpu -p int4
    -e cpu``, run in an environment with the transformers its builder needs)."""
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    assert entry.sha256 is not None
    return catalog.edgeinfer_home() / "derived" / f"{entry.sha256[:16]}-r2" / "ortgenai-int4-cpu"


def bench(args: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "edgeinfer.cli", "bench", *args, "--json"]
    print("$ edgeinfer bench " + " ".join(args), file=sys.stderr)
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"edgeinfer bench failed with status {out.returncode}")
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def _mean(row: dict[str, Any], figure: str) -> float:
    return float(row[figure]["mean"])


def targets(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, each as the measured ratio beside the target."""
    found: dict[str, Any] = {}
    for route, report in reports.items():
        rows = {(r["engine"], r["parallel"]): r for r in report["results"]}
        ours = {n: r for (e, n), r in rows.items() if e == "edgeinfer"}
        if 1 in ours and 8 in ours:
            found[f"{route}: aggregate decode, 8 streams / 1 stream"] = {
                "ratio": _mean(ours[8], "tg_tok_s") / _mean(ours[1], "tg_tok_s"),
                "all_decoding_ratio": _mean(ours[8], "steady_tg_tok_s")
                / _mean(ours[1], "steady_tg_tok_s"),
                "target": ">= 3 on the ONNX route" if route == "onnxruntime" else None,
            }
            found[f"{route}: TTFT joining 7 running streams / alone"] = {
                "ratio": _mean(ours[8], "join_ttft_ms") / _mean(ours[1], "join_ttft_ms"),
                "target": "<= 2",
            }
        for (engine, n), row in sorted(rows.items()):
            if engine == "onnxruntime-genai" and n in ours:
                found[f"{route}: edgeinfer / og.Engine, aggregate decode, {n} streams"] = {
                    "ratio": _mean(ours[n], "tg_tok_s") / _mean(row, "tg_tok_s"),
                    # every token over the time to the last one, prefill and waiting included
                    "start_to_end_ratio": _mean(ours[n], "done_tok_s") / _mean(row, "done_tok_s"),
                    "join_ttft_ms": {
                        "edgeinfer": _mean(ours[n], "join_ttft_ms"),
                        "og.Engine": _mean(row, "join_ttft_ms"),
                    },
                    "target": ">= 1",
                }
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--genai-folder", type=Path, default=None)
    parser.add_argument("-r", "--repetitions", default="5")
    parser.add_argument("-p", "--prompt-tokens", default="128")
    parser.add_argument("-n", "--new-tokens", default="128")
    parser.add_argument("--parallel", default=PARALLEL)
    parser.add_argument("--routes", default="onnxruntime,llama.cpp")
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    args = parser.parse_args()
    common = ["-p", args.prompt_tokens, "-n", args.new_tokens, "-r", args.repetitions,
              "--threads", "2", "--parallel", args.parallel]  # fmt: skip
    genai = args.genai_folder or default_genai_folder()
    run = conditions.start(2, int(args.repetitions))
    reports: dict[str, dict[str, Any]] = {}
    for route in args.routes.split(","):
        if route == "onnxruntime":
            peer = ["--compare", "--peer-model", str(genai)] if genai.is_dir() else []
            if not peer:
                print(f"no onnxruntime-genai folder at {genai}: og.Engine left out",
                      file=sys.stderr)  # fmt: skip
            reports[route] = bench([catalog.DEFAULT_MODEL, "--engine", "onnxruntime", *common,
                                    *peer])  # fmt: skip
        else:
            gguf = str(catalog.fetch(catalog.DEFAULT_MODEL))
            reports[route] = bench([gguf, "--engine", "llama.cpp", *common])
    record = {"targets": targets(reports), "reports": reports,
              "conditions": conditions.finish(run)}  # fmt: skip
    conditions.write(args.output, record)
    print(json.dumps(record["targets"], indent=1))
    print(f"written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
