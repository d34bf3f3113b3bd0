"""What the memory plan needs to know about a model, read from its own metadata.

``shape_of`` reads a resolved model (``loader.ModelSource``): a GGUF header's architecture
keys, or an ONNX folder's manifest and file sizes, into a ``ModelShape``: layers, heads,
head sizes, KV element size, vocabulary, trained context, the weight bytes on disk and the
files the engine maps. ``memory.plan_memory`` turns a shape into a ``MemoryPlan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "gguf_shape", "shape_of"]


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about a model, read from its metadata."""

    format: str  # "gguf" | "onnx"
    quantization: str
    weight_bytes: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    kv_element_bytes: int
    n_vocab: int
    trained_context: int
    tokenizer_bytes: int = 0
    files: tuple[str, ...] = ()  # the files the engine maps (weights), as absolute paths
    kv_cache: str = "grow"  # ONNX: "shared" when one preallocated buffer holds the cache
    # ONNX: the graph returns logits for every position of a prefill batch (optimum's and
    # onnxruntime-genai's graphs), not the last one only (the native builder's)
    logits_all_positions: bool = True

    @property
    def kv_bytes_per_token(self) -> int:
        return (
            self.n_layers
            * self.n_kv_heads
            * (self.head_dim_k + self.head_dim_v)
            * (self.kv_element_bytes)
        )


def shape_of(source: Any, kv_dtype: str = "auto") -> ModelShape:
    """The ModelShape of a resolved model (``loader.ModelSource``) with the KV cache type
    ``load(kv_dtype=)`` asks for (an ONNX folder's is its graph's)."""
    if source.format == "gguf":
        return gguf_shape(source.header, kv_dtype)
    return _onnx_shape(source.path, source.header)


def gguf_shape(header: Any, kv_dtype: str = "auto") -> ModelShape:
    """A GGUF header's shape as llama.cpp runs it: its KV cache is f16 unless float32 is
    asked for (the one rule the plan and the backend's ``kv_nbytes`` share)."""
    n_head = int(header.arch_value("attention.head_count", 1)) or 1
    n_embd = int(header.arch_value("embedding_length", 0))
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    n_vocab = int(header.arch_value("vocab_size", 0)) or int(getattr(tokens, "length", 0) or 0)
    if not n_vocab and isinstance(tokens, list):
        n_vocab = len(tokens)
    return ModelShape(
        format="gguf",
        quantization="default",
        weight_bytes=max(header.file_size - header.data_offset, header.weight_nbytes),
        n_layers=int(header.arch_value("block_count", 0)),
        n_heads=n_head,
        n_kv_heads=int(header.arch_value("attention.head_count_kv", n_head)),
        head_dim_k=int(header.arch_value("attention.key_length", n_embd // n_head)),
        head_dim_v=int(header.arch_value("attention.value_length", n_embd // n_head)),
        kv_element_bytes=4 if kv_dtype == "float32" else 2,
        n_vocab=n_vocab,
        trained_context=int(header.arch_value("context_length", 0)),
        files=(str(Path(header.path).resolve()),) if getattr(header, "path", None) else (),
    )


def _onnx_shape(folder: Path, manifest: Any) -> ModelShape:
    arch = manifest.architecture
    graph = folder / manifest.model_file
    files = [graph, *folder.glob(manifest.model_file + ".data")]
    weight_bytes = sum(p.stat().st_size for p in files if p.is_file())
    tokenizer = folder / manifest.tokenizer_file
    return ModelShape(
        format="onnx",
        quantization=str(manifest.quantization.get("method", "default")),
        weight_bytes=weight_bytes,
        n_layers=arch.num_layers,
        n_heads=max(1, arch.hidden_size // arch.head_dim) if arch.head_dim else 1,
        n_kv_heads=arch.num_kv_heads,
        head_dim_k=arch.head_dim,
        head_dim_v=arch.head_dim,
        kv_element_bytes=2 if arch.kv_dtype == "float16" else 4,
        n_vocab=arch.vocab_size,
        trained_context=arch.max_context,
        tokenizer_bytes=tokenizer.stat().st_size if tokenizer.is_file() else 0,
        files=tuple(str(p.resolve()) for p in files if p.is_file()),
        kv_cache=arch.kv_cache,
        logits_all_positions=manifest.quantization.get("builder") != "native",
    )
