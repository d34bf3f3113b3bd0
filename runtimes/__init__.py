"""Backends, one module per engine, resolved lazily by model format.

The registry maps a format to ``module:function``; the module (and its engine) is imported
only when a model of that format is opened. ``open_backend`` walks the provider plan: a
candidate that is missing, fails to create a session or rejects the graph is recorded with
its error and the next one is tried.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from edgeinfer.errors import BackendUnavailableError, EdgeInferError

if TYPE_CHECKING:
    from edgeinfer.config import LoadConfig
    from edgeinfer.files.source import ModelSource
    from edgeinfer.machine.policy import ProviderPlan

    from .base import Backend

__all__ = ["BACKENDS", "open_backend"]

logger = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {
    "gguf": "edgeinfer.runtimes.llama_cpp:open_backend",
    "onnx": "edgeinfer.runtimes.onnxruntime:open_backend",
    "encoder": "edgeinfer.runtimes.onnx_encoder:open_backend",  # embedding models
}


def open_backend(
    source: ModelSource, config: LoadConfig, plan: ProviderPlan
) -> tuple[Backend, list[dict[str, Any]]]:
    """Open ``source`` on the first candidate of ``plan`` that works.

    Returns the backend and the chain: one entry per candidate tried (``chosen`` or
    ``failed`` with its error) and one per provider the plan left out (``unavailable``).
    """
    target = BACKENDS.get(source.format)
    if target is None:
        raise BackendUnavailableError(
            f"no backend in this edgeinfer version runs {source.format!r} models "
            f"(supported: {', '.join(BACKENDS)})"
        )
    module_name, func_name = target.split(":")
    opener = getattr(importlib.import_module(module_name), func_name)
    chain: list[dict[str, Any]] = []
    for index, candidate in enumerate(plan.candidates):
        entry = {
            "provider": candidate.provider,
            "device": candidate.device,
            "reason": candidate.reason,
        }
        try:
            backend: Backend = opener(source.path, config, source.header, candidate)
        except Exception as exc:  # an accelerator path may fail in its own way: try the next
            chain.append({**entry, "outcome": "failed", "error": str(exc) or type(exc).__name__})
            logger.debug("%s failed for %s: %r", candidate.provider, source.name, exc)
            if index < len(plan.candidates) - 1:
                continue
            if isinstance(exc, EdgeInferError):
                raise _with_chain(exc, chain) from exc
            raise
        chain.append({**entry, "outcome": "chosen"})
        chain += [
            {"provider": s.provider, "outcome": "unavailable", "reason": s.reason}
            for s in plan.skipped
        ]
        _log_choice(source.name, chain)
        return backend, chain
    raise BackendUnavailableError(f"no provider can run {source.name}")  # empty plan


def _with_chain(exc: EdgeInferError, chain: list[dict[str, Any]]) -> EdgeInferError:
    if len(chain) < 2:
        return exc
    tried = "; ".join(f"{c['provider']}: {c['error']}" for c in chain[:-1])
    return type(exc)(f"{exc} (also tried {tried})")


def _log_choice(name: str, chain: list[dict[str, Any]]) -> None:
    chosen = next(c for c in chain if c["outcome"] == "chosen")
    failed = [c for c in chain if c["outcome"] == "failed"]
    if failed:
        logger.info(
            "%s runs on %s (%s) after %s",
            name,
            chosen["provider"],
            chosen["reason"],
            "; ".join(f"{c['provider']} failed: {c['error']}" for c in failed),
        )
    else:
        logger.info("%s runs on %s (%s)", name, chosen["provider"], chosen["reason"])
