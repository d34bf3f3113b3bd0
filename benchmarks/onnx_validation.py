"""The README's optimum validation table: each converted folder's own validation report.

Reads ``edgeinfer.json`` of the default model's ONNX conversions that the tests make
(``pytest -m model tests/test_onnx_backend.py``: optimum's export of the dequantized
checkpoint, validated against transformers in fp32 on 8 prompts x 16 tokens) and writes the
figures with each folder's build time, so the table names when they were measured.

    python benchmarks/onnx_validation.py [--derived DIR]

Writes benchmarks/results/onnx-validation.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
from pathlib import Path
from typing import Any

QUANTS = ("fp32", "int8wo", "int8", "int4")


def default_derived() -> Path:
    from edgeinfer.files import catalog

    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    assert entry.sha256 is not None
    return catalog.edgeinfer_home() / "derived" / f"{entry.sha256[:16]}-r2"


def row(folder: Path) -> dict[str, Any]:
    from edgeinfer.bounded_json import read_json_file

    manifest = folder / "edgeinfer.json"
    report = read_json_file(manifest)["validation"]
    built = dt.datetime.fromtimestamp(manifest.stat().st_mtime, tz=dt.UTC)
    top1, greedy = float(report["top1_agreement"]), float(report["greedy_agreement"])
    return {
        "folder": folder.name,
        "built_utc": built.isoformat(timespec="seconds"),
        "top1_agreement_pct": round(100 * top1, 1),
        "greedy_agreement_pct": round(100 * greedy, 1),
        "mean_kl": round(float(report["mean_kl"]), 4),
        "passes_defaults": passes_defaults(report),
        "report": {k: v for k, v in report.items() if k != "per_prompt"},
    }


def passes_defaults(report: dict[str, Any]) -> bool:
    """The verdict convert's default thresholds give these figures (the tests build the
    folders with thresholds of 0, so the report's own ``passed`` says nothing): decisive top-1
    and greedy agreement beyond ties; plain top-1 and greedy for reports made before those."""
    from edgeinfer.converters.config import ConvertConfig
    from edgeinfer.converters.validate import MAX_RELATIVE_KL, MIN_DECISIVE

    defaults = {f.name: f.default for f in dataclasses.fields(ConvertConfig)}
    top1, greedy = defaults["min_top1_agreement"], defaults["min_greedy_agreement"]
    if "decisive_top1_agreement" not in report:
        return report["top1_agreement"] >= top1 and report["greedy_agreement"] >= greedy
    if report["decisive_positions"] < MIN_DECISIVE:
        return report["relative_kl"] <= MAX_RELATIVE_KL
    return (
        report["decisive_top1_agreement"] >= top1
        and report["greedy_agreement_beyond_ties"] >= greedy
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--derived", type=Path, default=None)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "onnx-validation.json"
    )
    args = ap.parse_args()
    derived = args.derived or default_derived()
    rows = {q: row(derived / f"onnx-{q}") for q in QUANTS if (derived / f"onnx-{q}").is_dir()}
    args.out.write_text(json.dumps({"derived": str(derived), "rows": rows}, indent=1) + "\n")
    for quant, r in rows.items():
        print(quant, r["top1_agreement_pct"], r["greedy_agreement_pct"], r["mean_kl"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
