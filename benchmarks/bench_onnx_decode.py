"""edgeinfer's ONNX loop vs optimum's ORTModelForCausalLM.generate, same model folder.

Both run the ONNX model edgeinfer converted from the default GGUF (the folder keeps
config.json, so optimum loads it as it is), with the same intra-op threads. Workload as in
BENCHMARKS.md: fixed prompt ids (128 and 512), 128 greedy new tokens (EOS banned on both
sides), one subprocess per run, interleaved, 1 warm-up + N measured; medians and min-max.

    python benchmarks/bench_onnx_decode.py MODEL_FOLDER [--runs 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

NEW_TOKENS = 128
PROMPT_BASE = list(range(1000, 1512))


def run_edgeinfer(folder: str, n_prompt: int, threads: int) -> dict[str, float]:
    import edgeinfer

    with edgeinfer.load(folder, context_length=1024, threads=threads) as model:
        eos = [t for t in (0, 1, 2) if model._tokenizer.is_end_of_generation(t)]
        r = model.generate(
            PROMPT_BASE[:n_prompt],
            max_new_tokens=NEW_TOKENS,
            temperature=0,
            logit_bias={t: float("-inf") for t in eos},
        )
    return {
        "tokens": r.stats.completion_tokens,
        "ttft_s": r.stats.ttft_s,
        "decode_tok_s": r.stats.decode_tokens_per_s,
    }


def run_optimum(folder: str, n_prompt: int, threads: int) -> dict[str, float]:
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import LogitsProcessor, LogitsProcessorList

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    torch.set_num_threads(threads)
    model = ORTModelForCausalLM.from_pretrained(
        folder, session_options=options, provider="CPUExecutionProvider"
    )
    stamps: list[float] = []

    class Stamp(LogitsProcessor):  # called once per generated token, before it is chosen
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor([PROMPT_BASE[:n_prompt]])
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([Stamp()]),
    )
    n = out.shape[1] - n_prompt
    return {
        "tokens": n,
        "ttft_s": stamps[0] - t0,
        "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0,
    }


ENGINES = {"edgeinfer": run_edgeinfer, "optimum": run_optimum}


def measure(engine: str, folder: str, n_prompt: int, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", engine, folder, str(n_prompt), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        import warnings

        warnings.simplefilter("ignore")
        result = ENGINES[sys.argv[2]](sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        print(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="an ONNX model folder made by edgeinfer convert")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "onnx.json"))
    args = parser.parse_args()
    manifest = json.loads((Path(args.folder) / "edgeinfer.json").read_text())
    report: dict[str, object] = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "threads": args.threads,
        },
        "model": args.folder,
        "quantization": manifest["quantization"].get("method"),
        "new_tokens": NEW_TOKENS,
        "results": {},
    }
    for n_prompt in (128, 512):
        runs: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
        for i in range(args.runs + 1):  # round 0 is the warm-up
            for engine in ENGINES:
                r = measure(engine, args.folder, n_prompt, args.threads)
                if i:
                    runs[engine].append(r)
        med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in runs.items()}
        report["results"][f"prompt_{n_prompt}"] = {"median": med, "runs": runs}  # type: ignore[index]
        for engine, m in med.items():
            lo = min(r["decode_tok_s"] for r in runs[engine])
            hi = max(r["decode_tok_s"] for r in runs[engine])
            print(
                f"prompt {n_prompt:4d} {engine:<10} ttft {m['ttft_s'] * 1000:7.1f} ms  decode "
                f"{m['decode_tok_s']:6.1f} tok/s [{lo:.1f}-{hi:.1f}]  tokens {m['tokens']:.0f}"
            )
        ratio = med["edgeinfer"]["decode_tok_s"] / med["optimum"]["decode_tok_s"]
        print(f"prompt {n_prompt:4d} decode ratio edgeinfer/optimum: {ratio:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
