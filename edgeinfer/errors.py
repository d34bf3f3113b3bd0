"""Errors edgeinfer raises on purpose.

    EdgeInferError                      base of everything below
    ├── ModelLoadError                  missing, corrupt or unsupported model file
    │   └── ModelFetchError             a catalog model could not be fetched or verified
    ├── BackendUnavailableError         engine or provider not installed, or it failed
    ├── MemoryBudgetError               the memory plan does not fit the budget
    ├── ModelBusyError                  the model is serving another request (wait=False)
    ├── ConversionError                 export, quantization or validation failed
    ├── SnapshotError                   a KV snapshot is foreign, corrupt, another model's or
    │                                   settings', or could not be written
    └── InvalidRequestError             bad sampling arguments, prompt too long, bad messages
        ├── ChatTemplateError           the model's chat template failed to render
        ├── NotAnEmbeddingModelError    embed() on a model that generates text
        └── NotAGenerativeModelError    generate()/chat() on an embedding model

Engine exceptions are mapped at the backend boundary with ``raise ... from exc``, so the
original error stays attached as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "ChatTemplateError",
    "ConversionError",
    "EdgeInferError",
    "InvalidRequestError",
    "MemoryBudgetError",
    "ModelBusyError",
    "ModelFetchError",
    "ModelLoadError",
    "NotAGenerativeModelError",
    "NotAnEmbeddingModelError",
    "SnapshotError",
]


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: messages name a huge argument, not echo it."""
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


class EdgeInferError(Exception):
    """Base class of every error edgeinfer raises on purpose."""


class ModelLoadError(EdgeInferError):
    """The model file is missing, corrupt, truncated or of an unsupported kind."""


class ModelFetchError(ModelLoadError):
    """A catalog model could not be downloaded, verified or extracted."""


class BackendUnavailableError(EdgeInferError):
    """The engine or provider a model needs is not installed or failed to start."""


class MemoryBudgetError(EdgeInferError):
    """The memory plan for a model does not fit the budget."""


class ModelBusyError(EdgeInferError):
    """The model is serving another request and the caller asked not to wait."""


class ConversionError(EdgeInferError):
    """Export, quantization or validation of a converted model failed."""


class InvalidRequestError(EdgeInferError, ValueError):
    """A request's arguments are invalid (sampling values, prompt length, messages)."""


class ChatTemplateError(InvalidRequestError):
    """The model's chat template is missing or failed to render the messages."""


class NotAnEmbeddingModelError(InvalidRequestError):
    """``embed`` was called on a model that generates text."""


class NotAGenerativeModelError(InvalidRequestError):
    """``generate``/``chat`` was called on an embedding model."""


class SnapshotError(EdgeInferError):
    """A KV snapshot (``save_state``/``load_state``, the prompt cache) is not a snapshot, is
    truncated or corrupt, was made by another model, engine or settings, or could not be
    written (full disk, no permission)."""
