"""edgeinfer vs llama-cpp-python's create_completion(stream=True) on the same GGUF file.

Protocol (BENCHMARKS.md): fixed prompt token ids (128 and 512), 128
greedy new tokens, context 1024, the same thread count for both, one subprocess per run,
engines interleaved, 1 warm-up and N measured runs each; medians and min-max.

    python benchmarks/bench_decode.py [--runs 5] [--threads 2] [--out FILE.json]
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
CONTEXT = 1024
# Fixed prompt ids: ordinary word tokens of the default vocabulary, so the model keeps talking.
PROMPT_BASE = list(range(1000, 1512))


def prompt_ids(n: int) -> list[int]:
    return PROMPT_BASE[:n]


def run_edgeinfer(path: str, n_prompt: int, threads: int) -> dict[str, float]:
    import edgeinfer

    with edgeinfer.load(path, context_length=CONTEXT, threads=threads) as model:
        eos = [
            t for t in range(model.info["vocab_size"]) if model._tokenizer.is_end_of_generation(t)
        ]
        r = model.generate(
            prompt_ids(n_prompt),
            max_new_tokens=NEW_TOKENS,
            temperature=0,
            logit_bias={t: float("-inf") for t in eos},
        )
    s = r.stats
    return {
        "tokens": s.completion_tokens,
        "ttft_s": s.ttft_s,
        "prefill_tok_s": s.prefill_tokens_per_s,
        "decode_tok_s": s.decode_tokens_per_s,
    }


def run_llama_cpp_python(path: str, n_prompt: int, threads: int) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads, verbose=False)
    t0 = time.perf_counter()
    stamps = []
    for chunk in llm.create_completion(
        prompt_ids(n_prompt), max_tokens=NEW_TOKENS, temperature=0, stream=True
    ):
        if chunk["choices"][0]["finish_reason"] is None:  # the last chunk only closes
            stamps.append(time.perf_counter())
    llm.close()
    n = len(stamps)  # one chunk per token (tokens held for incomplete text merge: a lower bound)
    return {
        "tokens": n,
        "ttft_s": stamps[0] - t0,
        "prefill_tok_s": n_prompt / (stamps[0] - t0),
        "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0,
    }


ENGINES = {"edgeinfer": run_edgeinfer, "llama-cpp-python": run_llama_cpp_python}


def child(engine: str, path: str, n_prompt: int, threads: int) -> None:
    import resource

    result = ENGINES[engine](path, n_prompt, threads)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def measure(engine: str, path: str, n_prompt: int, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", engine, path, str(n_prompt), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(runs: list[dict[str, float]]) -> dict[str, list[float]]:
    keys = runs[0].keys()
    return {
        k: [statistics.median(r[k] for r in runs), min(r[k] for r in runs), max(r[k] for r in runs)]
        for k in keys
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    args = parser.parse_args()
    from edgeinfer import catalog

    path = str(catalog.fetch(catalog.DEFAULT_MODEL))
    report: dict[str, object] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "threads": args.threads,
        },
        "model": catalog.DEFAULT_MODEL,
        "new_tokens": NEW_TOKENS,
        "context": CONTEXT,
        "results": {},
    }
    for n_prompt in (128, 512):
        runs: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
        for i in range(args.runs + 1):  # the first round is the warm-up
            for engine in ENGINES:
                r = measure(engine, path, n_prompt, args.threads)
                if i:
                    runs[engine].append(r)
        table = {e: summary(r) for e, r in runs.items()}
        report["results"][f"prompt_{n_prompt}"] = {"summary": table, "runs": runs}  # type: ignore[index]
        for engine, s in table.items():
            print(
                f"prompt {n_prompt:4d} {engine:<17} ttft {s['ttft_s'][0] * 1000:7.1f} ms  "
                f"prefill {s['prefill_tok_s'][0]:7.1f} tok/s  decode {s['decode_tok_s'][0]:6.1f} "
                f"tok/s [{s['decode_tok_s'][1]:.1f}-{s['decode_tok_s'][2]:.1f}]  "
                f"tokens {s['tokens'][0]:.0f}  peak RSS {s['peak_rss_mb'][0]:.0f} MB"
            )
        ours, peer = table["edgeinfer"], table["llama-cpp-python"]
        print(
            f"prompt {n_prompt:4d} ratio edgeinfer/llama-cpp-python: decode "
            f"{ours['decode_tok_s'][0] / peer['decode_tok_s'][0]:.2f}x, ttft "
            f"{ours['ttft_s'][0] / peer['ttft_s'][0]:.2f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
