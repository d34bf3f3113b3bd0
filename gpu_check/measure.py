"""One load of one model, measured, in a process of its own: ``gpu_check.run`` starts it.

``python -m gpu_check.measure SPEC_JSON`` loads ``spec["model"]`` with ``edgeinfer.load`` and
``spec["load"]`` (device, engine, context_length, threads), decodes greedily once to warm up
and once timed, and prints one JSON line: the route and provider chosen, the layers llama.cpp
says it offloaded, decode tokens per second, the memory plan, and what ``nvidia-smi`` shows
for the GPU before the load, after it and after the timed reply (this process's own memory
where nvidia-smi lists it by pid; the card's used memory either way). An error raised on
purpose is reported as ``{"error": ...}``; the process exits 0 whenever it could say so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

from .nvidia import (
    GPU_QUERY,
    PROCESS_QUERY,
    CheckError,
    parse_gpus,
    parse_offloaded,
    parse_process_memory,
)

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def gpu_memory() -> dict[str, Any] | None:
    """The card's used MiB and this process's MiB (None where nvidia-smi does not list it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    gpus = _smi(f"--query-gpu={GPU_QUERY}")
    apps = _smi(f"--query-compute-apps={PROCESS_QUERY}")
    try:
        used = [g.memory_used_mib for g in parse_gpus(gpus or "")]
    except CheckError:
        used = []
    return {"used_mib": used, "process_mib": parse_process_memory(apps or "").get(os.getpid())}


def _smi(query: str) -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def prepare(spec: dict[str, Any]) -> str | None:
    """Why ``spec``'s model cannot be measured here (a catalog model that is not present:
    nothing is fetched), or None; writes the tiny random model when it is asked for."""
    if spec.get("write_tiny"):
        from pathlib import Path

        from tests.ggufgen import tiny_llama

        path = Path(spec["model"])
        if not path.exists():  # a Llama of 4 layers, f32 random weights: llama.cpp offloads it
            tiny_llama(hidden=256, heads=4, kv_heads=2, layers=4, ffn=512, context=2048,
                       seed=1).write(path)  # fmt: skip
        return None
    if spec.get("catalog"):
        from edgeinfer.files import catalog

        name = spec["model"]
        entry = catalog.lookup(name)
        if entry is None:
            return f"{name} is not in this checkout's catalog"
        if not catalog.is_present(entry):
            return (
                f"{name} is not in {catalog.local_path(entry)} and this check fetches nothing; "
                f"fetch it where there is a network (edgeinfer models fetch {name}) and carry "
                "$EDGEINFER_HOME/models with the check, or run it where the models are"
            )
    return None


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import edgeinfer

    why = prepare(spec)
    if why is not None:
        return {"skipped": why}
    log: list[str] = []
    with ExitStack() as stack:
        try:
            from edgeinfer.runtimes.llama_cpp import engine_log_listener

            stack.enter_context(engine_log_listener(log.append))
        except ImportError:  # no llama-cpp-python: an ONNX route only
            pass
        before = gpu_memory()
        start = time.perf_counter()
        with edgeinfer.load(spec["model"], **spec.get("load", {})) as model:
            load_s = time.perf_counter() - start
            loaded = gpu_memory()
            result = _decode(model, int(spec.get("max_new_tokens", 128)))
            info = model.info
            after = gpu_memory()
    return {
        "load": spec.get("load", {}),
        "route": info.get("route"),
        "provider": info.get("provider"),
        "device": info.get("device"),
        "n_gpu_layers": info.get("n_gpu_layers"),
        "layers_offloaded": parse_offloaded(log),
        "fallback_chain": info.get("fallback_chain"),
        "load_s": round(load_s, 3),
        **result,
        "memory_plan": info.get("memory_plan"),
        "gpu_memory": {"before_load": before, "after_load": loaded, "after_reply": after},
    }


def _end_ids(model: Any) -> list[int]:
    """The model's end-of-generation ids, banned while timing so that every route decodes the
    same number of tokens (routes' logits differ a little, and a near tie with an end token
    can stop one of them at once)."""
    tokenizer = getattr(model, "_tokenizer", None)
    if tokenizer is None:
        return []
    return [i for i in range(int(model.info["vocab_size"])) if tokenizer.is_end_of_generation(i)]


def _decode(model: Any, max_new_tokens: int) -> dict[str, Any]:
    banned = _end_ids(model)
    greedy = {"temperature": 0.0, "seed": 0, "logit_bias": {i: float("-inf") for i in banned}}
    model.generate(PROMPT, max_new_tokens=8, **greedy)  # warm-up: kernels, graphs, caches
    reply = model.generate(PROMPT, max_new_tokens=max_new_tokens, **greedy)
    s = reply.stats
    return {
        "end_of_generation_ids_banned": banned,
        "completion_tokens": s.completion_tokens,
        "finish_reason": reply.finish_reason,
        "decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
        "ttft_s": round(s.ttft_s, 4),
        "prefill_tokens_per_s": round(s.prefill_tokens_per_s, 1),
        "peak_rss_bytes": s.peak_rss_bytes,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gpu_check.measure SPEC_JSON", file=sys.stderr)
        return 2
    from edgeinfer.errors import EdgeInferError

    try:
        out = measure(json.loads(argv[0]))
    except EdgeInferError as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
