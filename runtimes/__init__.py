"""Backends, one module per engine, resolved lazily by model format.

The registry maps a format to ``module:function``; the module (and its engine) is imported
only when a model of that format is opened.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from edgeinfer.errors import BackendUnavailableError

if TYPE_CHECKING:
    from edgeinfer.config import LoadConfig
    from edgeinfer.loader import ModelSource

    from .base import Backend

__all__ = ["BACKENDS", "open_backend"]

BACKENDS: dict[str, str] = {
    "gguf": "edgeinfer.runtimes.llama_cpp:open_backend",
    "onnx": "edgeinfer.runtimes.onnxruntime:open_backend",
}


def open_backend(source: ModelSource, config: LoadConfig) -> Backend:
    target = BACKENDS.get(source.format)
    if target is None:
        raise BackendUnavailableError(
            f"no backend in this edgeinfer version runs {source.format!r} models "
            f"(supported: {', '.join(BACKENDS)})"
        )
    module_name, func_name = target.split(":")
    opener = getattr(importlib.import_module(module_name), func_name)
    backend: Backend = opener(source.path, config, source.header)
    return backend
