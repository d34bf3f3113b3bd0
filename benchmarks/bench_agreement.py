"""How closely a converted model can agree with llama.cpp on the validation prompts, against
how closely llama.cpp agrees with itself.

Runs the conversion validation (8 prompts, 16 greedy tokens each: top-1 teacher-forced
agreement, greedy agreement, mean KL, and the measures the verdict uses, which do not count
near-ties: decisive top-1, greedy agreement beyond ties, relative KL) for three pairs on the
default model:

- llama.cpp (its default f16 KV cache) against llama.cpp with an f32 KV cache: the spread of
  llama.cpp's own numerics;
- llama.cpp (f16 KV) against a native ONNX folder: what `edgeinfer convert` reports;
- llama.cpp (f32 KV) against the same folder.

    python benchmarks/bench_agreement.py NATIVE_FOLDER [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def _f32_cache(backend_class: Any) -> Any:
    """Make the llama.cpp backend create its contexts with an f32 KV cache (type 0)."""
    original = backend_class._new_context

    def new_context(self: Any) -> Any:
        defaults = self._llama.llama_context_default_params

        def params() -> Any:
            p = defaults()
            p.type_k = p.type_v = 0  # GGML_TYPE_F32
            return p

        self._llama.llama_context_default_params = params
        try:
            return original(self)
        finally:
            self._llama.llama_context_default_params = defaults

    return new_context


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a native ONNX folder of the default model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "agreement.json"
    )
    args = parser.parse_args()
    import edgeinfer
    from edgeinfer.converters.config import ConvertConfig
    from edgeinfer.converters.validate import ModelReference, compare, open_result
    from edgeinfer.files import catalog
    from edgeinfer.files.manifest import Manifest
    from edgeinfer.runtimes import llama_cpp

    gguf = catalog.fetch(catalog.DEFAULT_MODEL)
    cfg = ConvertConfig(gguf, args.folder.parent / "unused")
    load = {"device": "cpu", "context_length": 256, "threads": args.threads}
    backend_class = llama_cpp.LlamaCppBackend
    default_context = backend_class._new_context
    f16 = edgeinfer.load(gguf, **load)
    backend_class._new_context = _f32_cache(backend_class)
    try:
        f32 = edgeinfer.load(gguf, **load)
    finally:
        backend_class._new_context = default_context

    def figures(report: dict[str, Any]) -> dict[str, Any]:
        keys = ("top1_agreement", "greedy_agreement", "mean_kl", "decisive_positions",
                "decisive_top1_agreement", "greedy_agreement_beyond_ties",
                "mean_greedy_prefix", "relative_kl", "positions", "passed")  # fmt: skip
        return {k: report[k] for k in keys}

    load_before = os.getloadavg()

    results = {
        "llama.cpp f16 KV vs llama.cpp f32 KV": figures(compare(ModelReference(f16), f32, cfg))
    }
    with open_result(args.folder, Manifest.read(args.folder), args.threads) as native:
        for name, reference in (("f16", f16), ("f32", f32)):
            report = compare(ModelReference(reference), native, cfg)
            results[f"llama.cpp {name} KV vs native ONNX"] = figures(report)
    f16.close()
    f32.close()
    record = {
        "command": f"python benchmarks/bench_agreement.py {args.folder} --threads {args.threads}",
        "threads": args.threads,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "pairs": results,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for name, row in results.items():
        print(
            f"{name:40s} top-1 {row['top1_agreement']:.1%} (decisive "
            f"{row['decisive_top1_agreement']:.1%}), greedy {row['greedy_agreement']:.1%} "
            f"(beyond ties {row['greedy_agreement_beyond_ties']:.1%}), passed {row['passed']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
