"""Prove a converted model still answers like its source.

On a fixed set of prompts the source checkpoint (transformers, fp32) and the converted model
(through edgeinfer's own runtime) are compared:
- top-1 agreement: teacher-forced along the source's greedy continuation, how often the
  result's most likely next token is the source's;
- mean KL divergence KL(source || result) of those next-token distributions;
- greedy agreement: the result's own greedy continuation against the source's, as the mean
  fraction of the source continuation reproduced before the first difference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.config import LoadConfig
from edgeinfer.manifest import Manifest
from edgeinfer.model import Model

from .config import ConvertConfig

__all__ = [
    "VALIDATION_PROMPTS",
    "ModelReference",
    "TransformersReference",
    "compare",
    "validate_conversion",
]

logger = logging.getLogger(__name__)

VALIDATION_PROMPTS = (
    "The capital of France is",
    "The largest planet in the solar system is",
    "Water freezes at a temperature of",
    "The first president of the United States was",
    "def add(a, b):\n    return",
    "Once upon a time, there was a",
    "The chemical symbol for gold is",
    "Monday, Tuesday, Wednesday,",
)


def validate_conversion(
    source: Path, folder: Path, manifest: Manifest, cfg: ConvertConfig
) -> dict[str, Any]:
    """Compare the checkpoint in ``source`` with the converted ONNX model in ``folder``."""
    reference = TransformersReference(source)
    with open_result(folder, manifest, cfg.threads) as model:
        return compare(reference, model, cfg)


@contextmanager
def open_result(folder: Path, manifest: Manifest, threads: int | None) -> Iterator[Model]:
    """The converted folder (still marked partial) as a Model on the CPU, context 256."""
    from edgeinfer.inventory import devices
    from edgeinfer.policy import plan_providers
    from edgeinfer.runtimes.onnxruntime import open_backend

    cpu = plan_providers(devices(), "onnx", "cpu").candidates[0]  # validation runs on the CPU
    backend = open_backend(folder, LoadConfig(context_length=256, threads=threads), manifest, cpu)
    model = Model(backend, name=folder.name, path=folder, model_format="onnx")
    try:
        yield model
    finally:
        model.close()


def compare(
    reference: Any,
    model: Model,
    cfg: ConvertConfig,
    *,
    on_prompt: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Compare ``model`` with ``reference`` (anything with ``run(ids, n, is_eos)`` returning
    the greedy continuation and the next-token logits along it) on the fixed prompts;
    ``on_prompt(i, n)`` before each."""
    rows = []
    for i, prompt in enumerate(VALIDATION_PROMPTS, 1):
        if on_prompt is not None:
            on_prompt(i, len(VALIDATION_PROMPTS))
        rows.append(_compare(reference, model, prompt, cfg.validation_tokens))
    return _report(rows, cfg)


class TransformersReference:
    """The source checkpoint through transformers, in float32 (needs torch)."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self._model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def run(self, ids: list[int], n: int, is_eos: Any) -> tuple[list[int], np.ndarray]:
        torch = self._torch
        with torch.no_grad():
            out = self._model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            continuation = _until_eos([int(t) for t in out[0, len(ids) :]], is_eos)
            forced = ids + continuation[:-1] if continuation else ids
            # [positions, vocab]: the next-token logits after the prompt and each token
            logits = self._model(torch.tensor([forced])).logits[0, len(ids) - 1 :]
        return continuation, logits.float().numpy()


class ModelReference:
    """Another edgeinfer model as the reference (the unquantized GGUF, say): no torch."""

    def __init__(self, model: Model) -> None:
        self._model = model

    def run(self, ids: list[int], n: int, is_eos: Any) -> tuple[list[int], np.ndarray]:
        result = self._model.generate(ids, max_new_tokens=n, temperature=0)
        continuation = _until_eos(list(result.token_ids), is_eos)
        return continuation, _teacher_forced(self._model, ids, continuation[:-1])


def _compare(reference: Any, model: Model, prompt: str, n: int) -> dict[str, Any]:
    ids = model.tokenize(prompt)
    eos = model._tokenizer.is_end_of_generation
    continuation, src = reference.run(ids, n, eos)
    res = _teacher_forced(model, ids, continuation[:-1])
    greedy = model.generate(ids, max_new_tokens=max(len(continuation), 1), temperature=0)
    agree = _common_prefix(continuation, list(greedy.token_ids))
    return {
        "prompt": prompt,
        "positions": len(src),
        "top1_matches": int((src.argmax(-1) == res.argmax(-1)).sum()),
        "kl": _mean_kl(src, res),
        "greedy_fraction": agree / len(continuation) if continuation else 1.0,
        "source_text": model.detokenize(continuation),
        "result_text": greedy.text,
    }


def _teacher_forced(model: Model, prompt: list[int], forced: Sequence[int]) -> np.ndarray:
    backend = model._backend
    model._history.tokens = []
    model._history.batched = 0
    backend.rewind(0)
    rows = [np.array(backend.prefill(prompt), dtype=np.float32)]
    for token in forced:
        rows.append(np.array(backend.decode(token), dtype=np.float32))
    backend.rewind(0)
    return np.stack(rows)


def _until_eos(tokens: list[int], is_eos: Any) -> list[int]:
    for i, token in enumerate(tokens):
        if is_eos(token):
            return tokens[:i]
    return tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _mean_kl(src: np.ndarray, res: np.ndarray) -> float:
    """Mean over positions of KL(p_src || p_res), in nats. src, res: [positions, vocab]."""
    log_p = _log_softmax(src.astype(np.float64))
    log_q = _log_softmax(res.astype(np.float64))
    return float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _report(rows: list[dict[str, Any]], cfg: ConvertConfig) -> dict[str, Any]:
    positions = sum(r["positions"] for r in rows)
    top1 = sum(r["top1_matches"] for r in rows) / max(positions, 1)
    greedy = float(np.mean([r["greedy_fraction"] for r in rows]))
    passed = top1 >= cfg.min_top1_agreement and greedy >= cfg.min_greedy_agreement
    return {
        "prompts": len(rows),
        "positions": positions,
        "top1_agreement": round(top1, 4),
        "greedy_agreement": round(greedy, 4),
        "mean_kl": round(float(np.mean([r["kl"] for r in rows])), 6),
        "thresholds": {"top1": cfg.min_top1_agreement, "greedy": cfg.min_greedy_agreement},
        "passed": passed,
        "per_prompt": rows,
    }
