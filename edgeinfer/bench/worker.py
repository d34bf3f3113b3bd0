"""One measured run in a fresh process: ``python -m edgeinfer.bench.worker`` reads a run's
spec (JSON) on stdin, runs the workload through one engine and prints one result line.

Every engine is timed the same way, from the outside: the clock starts when the prompt is
handed over and each generated token is stamped when the engine hands it back. A fresh
process per run keeps each run's peak resident memory its own.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..errors import EdgeInferError
from ..memory.rss import peak_rss
from .peers import policy_llama
from .streams import run_edgeinfer_parallel, run_genai_engine
from .workload import end_of_generation_ids, prompt_ids

RESULT_MARK = "edgeinfer-bench-result "

Spec = dict[str, Any]


def timings(t0: float, stamps: list[float], n_prompt: int) -> dict[str, float]:
    """The figures of one run from the start time and one stamp per generated token."""
    if not stamps:
        return {"tokens": 0, "ttft_s": 0.0, "prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    n = len(stamps)
    ttft = stamps[0] - t0
    span = stamps[-1] - stamps[0]
    return {
        "tokens": n,
        "ttft_s": ttft,
        "prefill_tok_s": n_prompt / ttft if ttft > 0 else 0.0,
        "decode_tok_s": (n - 1) / span if n > 1 and span > 0 else 0.0,
    }


def run_edgeinfer(spec: Spec) -> dict[str, Any]:
    from ..loader import load

    with load(
        spec["model"],
        device=spec["device"],
        memory_budget=spec["memory_budget"],
        context_length=spec["context_length"],
        threads=spec["threads"],
        speculative=spec.get("speculative", "off"),
        **({"engine": spec["route"]} if spec.get("route") else {}),
    ) as model:
        ids = prompt_ids(model, spec["prompt_tokens"])
        ban = end_of_generation_ids(model)
        stamps: list[float] = []
        t0 = time.perf_counter()
        with model.stream(
            ids,
            max_new_tokens=spec["new_tokens"],
            temperature=0,
            logit_bias={t: float("-inf") for t in ban},
        ) as stream:
            for chunk in stream:
                if chunk.token_ids:
                    now = time.perf_counter()
                    stamps.extend([now] * len(chunk.token_ids))
        assert stream.result is not None
        info = model.info
    plan = info.get("memory_plan") or {}
    return {
        **timings(t0, stamps, len(ids)),
        "provider": info["provider"],
        "device": info["device"],
        "n_gpu_layers": info.get("n_gpu_layers"),
        "context_length": info["context_length"],
        "plan_total_bytes": plan.get("total"),
        "prompt_ids": ids,
        "ban_ids": ban,
        "engine_stats": asdict(stream.result.stats),
    }


def run_llama_cpp_python(spec: Spec) -> dict[str, Any]:
    ids, n = spec["prompt_ids"], spec["new_tokens"]
    llm = policy_llama(
        spec["model"],
        n_ctx=spec["context_length"],
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        n_gpu_layers=spec.get("n_gpu_layers") or 0,
        verbose=False,
    )
    stamps: list[float] = []
    try:
        t0 = time.perf_counter()
        for chunk in llm.create_completion(
            ids,
            max_tokens=n,
            temperature=0,
            logit_bias={t: float("-inf") for t in spec["ban_ids"]},
            stream=True,
        ):
            if chunk["choices"][0]["finish_reason"] is None:  # the last chunk only closes
                stamps.append(time.perf_counter())
    finally:
        llm.close()
    return {
        **timings(t0, stamps, len(ids)),
        "provider": "llama.cpp:GPU" if spec.get("n_gpu_layers") else "llama.cpp:CPU",
        "device": spec["device"],
        "context_length": spec["context_length"],
    }


def run_optimum(spec: Spec) -> dict[str, Any]:
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    ids, n, threads = spec["prompt_ids"], spec["new_tokens"], spec["threads"]
    provider = spec.get("provider") or ""
    if not provider.endswith("ExecutionProvider"):
        provider = "CPUExecutionProvider"
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    torch.set_num_threads(threads)
    model = ORTModelForCausalLM.from_pretrained(
        spec["model"], session_options=options, provider=provider
    )
    stamps: list[float] = []

    class Stamps(BaseStreamer):  # type: ignore[misc]
        prompt_seen = False

        def put(self, value: Any) -> None:
            if not self.prompt_seen:  # generate() hands the prompt over first
                self.prompt_seen = True
                return
            stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    prompt = torch.tensor([ids])
    ban = spec["ban_ids"]
    t0 = time.perf_counter()
    model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        suppress_tokens=ban or None,
        pad_token_id=ban[0] if ban else 0,
        streamer=Stamps(),
    )
    return {**timings(t0, stamps, len(ids)), "provider": provider, "device": spec["device"]}


def run_onnxruntime_genai(spec: Spec) -> dict[str, Any]:
    import onnxruntime_genai as og

    ids, n, threads = spec["prompt_ids"], spec["new_tokens"], spec["threads"]
    config = og.Config(spec["model"])
    config.overlay(
        json.dumps(
            {
                "model": {
                    "decoder": {
                        "session_options": {
                            "intra_op_num_threads": threads,
                            "inter_op_num_threads": 1,
                        }
                    }
                }
            }
        )
    )
    config.clear_providers()  # none: the CPU
    device = "cuda" if spec["device"] in ("cuda", "gpu") else "cpu"
    if device == "cuda":
        config.append_provider("cuda")
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(
        do_sample=False, max_length=len(ids) + n, min_length=len(ids) + n, batch_size=1
    )
    generator = og.Generator(model, params)
    stamps: list[float] = []
    t0 = time.perf_counter()
    generator.append_tokens(ids)
    while not generator.is_done() and len(stamps) < n:
        generator.generate_next_token()
        generator.get_next_tokens()
        stamps.append(time.perf_counter())
    del generator
    return {
        **timings(t0, stamps, len(ids)),
        "provider": f"onnxruntime-genai:{device}",
        "device": device,
    }


ENGINES: dict[str, Callable[[Spec], dict[str, Any]]] = {
    "edgeinfer": run_edgeinfer,
    "llama-cpp-python": run_llama_cpp_python,
    "optimum": run_optimum,
    "onnxruntime-genai": run_onnxruntime_genai,
}
# with --parallel: the engines that run many streams at once (a spec with "parallel")
PARALLEL_ENGINES: dict[str, Callable[[Spec], dict[str, Any]]] = {
    "edgeinfer": run_edgeinfer_parallel,
    "onnxruntime-genai": run_genai_engine,
}


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> int:
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.ERROR)
    spec = json.loads(sys.stdin.read())
    try:
        engines = PARALLEL_ENGINES if spec.get("parallel") else ENGINES
        result = engines[spec["engine"]](spec)
    except EdgeInferError as exc:
        emit({"error": {"type": type(exc).__name__, "message": str(exc)}})
        return 1
    except Exception as exc:  # a peer's own failure: reported, the benchmark goes on
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
        emit({"error": {"type": type(exc).__name__, "message": message}})
        return 1
    result["peak_rss_bytes"] = peak_rss()
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
