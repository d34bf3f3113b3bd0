"""What each engine costs in host memory, measured: the constants ``memory.plan_memory``
adds up (how and where they were measured: ``edgeinfer/memory/plan.py``'s docstring).

``costs_for(shape)`` picks the costs of the engine and graph kind that will run a model:
llama.cpp for a GGUF file, onnxruntime for an ONNX graph whose cache grows each step, or for
one whose cache is a single preallocated buffer (the native builder's, onnxruntime-genai's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .shape import ModelShape

__all__ = ["COSTS", "THREAD_BYTES", "EngineCosts", "costs_for"]

MiB = 2**20
THREAD_BYTES = 2 * MiB  # per compute thread (see plan.py's "Margin")
# Per decoding slot beyond the first: its row of float32 logits in the engine's output and
# in the [k, vocab] array a batched step returns (2 x 4 bytes per vocabulary entry).
SLOT_LOGITS_BYTES = 8


@dataclass(frozen=True)
class EngineCosts:
    import_bytes: int  # the engine's libraries and Python modules once imported
    fixed_bytes: int  # per loaded model, besides weights, KV and compute
    vocab_bytes: float  # per vocabulary entry (llama.cpp's vocab; tokenizer tables)
    tokenizer_file_factor: float  # resident bytes per byte of tokenizer.json (ONNX)
    kv_factor: (
        float  # resident bytes per KV cache byte: cache instances alive in a step + workspace
    )
    score_bytes: float  # per (batch x context x attention head): scores and softmax
    compute_fixed_bytes: int  # per model: activations, logits of the last position
    thread_bytes: int  # per compute thread: stack, allocator arena, kernel scratch
    logits_per_batch_token: int  # bytes of logits computed per prefill token (x vocab)
    weight_factor: dict[str, float]  # resident weights / bytes on disk, per quantization
    batch_token_bytes: int = 0  # per prefill token: activations besides scores and logits


COSTS = {
    # llama.cpp, CPU: libllama/libggml 9 MiB; vocab structures ~18 MiB for 49k tokens; the
    # compute buffer's touched part fits 5.6 B x batch x context x heads + 8 MiB (measured
    # at contexts 256..8192 and batches 64..512); logits only for the last position.
    "gguf": EngineCosts(
        import_bytes=10 * MiB,
        fixed_bytes=12 * MiB,
        vocab_bytes=120,
        tokenizer_file_factor=0.0,
        kv_factor=1.0,
        score_bytes=5.8,
        compute_fixed_bytes=11 * MiB,
        thread_bytes=THREAD_BYTES,
        logits_per_batch_token=0,
        weight_factor={"default": 1.0},
    ),
    # onnxruntime, CPU: onnxruntime + tokenizers 22 MiB; the tokenizers library holds ~7x the
    # size of tokenizer.json; optimum's graph returns the grown cache beside the old one and
    # computes logits for every prefill position. Measured on the default model's int8
    # conversion, resident memory grows by 2.75x the KV cache per token of context (two cache
    # instances during a step, plus attention workspace and arena slack); weight residency per
    # quantization measured after session creation (pre-packing copies some weights). int8:
    # 1.55 counts the mapped fp32 embedding (113 MB, read row by row as tokens appear) in full
    # besides the pre-packed int8 weights (measured at load with FitAtLoad's accounting).
    "onnx": EngineCosts(
        import_bytes=22 * MiB,
        fixed_bytes=8 * MiB,
        vocab_bytes=0,
        tokenizer_file_factor=7.0,
        kv_factor=2.75,
        score_bytes=8.0,
        compute_fixed_bytes=8 * MiB,
        thread_bytes=THREAD_BYTES,
        # the graph's [batch, vocab] fp32 logits in the arena. The backend keeps a copy of
        # the last row only, so the previous chunk's block is back in the arena while the
        # next chunk runs (a view of it was held before: measured +100 MB at batch 512 with
        # a 49k vocabulary, when this was 8)
        logits_per_batch_token=4,
        weight_factor={"fp32": 1.05, "fp16": 1.05, "int8": 1.55, "int4": 1.05, "int8wo": 0.75,
                       "default": 1.2},
    ),
}  # fmt: skip
# onnxruntime on a graph with one preallocated KV buffer written in place (GroupQueryAttention,
# the native builder's graphs) that returns the last position's logits only. Measured with
# `python benchmarks/bench_memory.py --model <native folder> --budgets 512MB 768MB 1GB` on the
# default model: peak - at load - KV = 46 / 49 / 62 MB at (context, batch) 1280/64, 2048/256,
# 2048/512, so no second cache instance and no per-token logits; onnxruntime pre-packs the
# MatMulNBits weights beside the mapped file (at load: 1.6x the weight file). Re-measured
# with a prompt spread over the vocabulary filling the context (issue 23, onnxruntime 1.32,
# native graphs with and without the batch axis, 1 to 8 slots, 2 threads): peak - at load -
# KV = 79 MB at batch 256 and 97-99 MB at batch 512 (contexts 512..1024): ~74 KB per prefill
# token (int8 activations and GEMM packing of MatMulNBits at accuracy level 4) over ~60 MB,
# above the 40 MiB first fitted; hence 48 MiB + 80 KiB per prefill token.
COSTS["onnx-shared"] = dataclasses.replace(
    COSTS["onnx"],
    kv_factor=1.0,
    score_bytes=2.0,
    compute_fixed_bytes=48 * MiB,
    batch_token_bytes=80 * 1024,
    logits_per_batch_token=0,
    weight_factor={"gguf-blocks": 1.6, "default": 1.6},
)


def costs_for(shape: ModelShape) -> EngineCosts:
    """The measured costs of the engine and graph kind that will run ``shape``."""
    costs = COSTS["onnx-shared" if shape.kv_cache == "shared" else shape.format]
    if shape.kv_cache == "shared" and shape.logits_all_positions:  # onnxruntime-genai's graphs
        costs = dataclasses.replace(
            costs, logits_per_batch_token=COSTS["onnx"].logits_per_batch_token
        )
    return costs
