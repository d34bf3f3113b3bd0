"""edgeinfer: run language models on the device in front of you, offline.

    import edgeinfer
    with edgeinfer.load("smollm2-135m-instruct") as model:
        for chunk in model.stream("The capital of France is", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

Importing this package loads only the standard library, numpy and psutil; engines are
imported when a model of their format is loaded.
"""

from __future__ import annotations

from .config import LoadConfig
from .errors import (
    BackendUnavailableError,
    ChatTemplateError,
    ConversionError,
    EdgeInferError,
    InvalidRequestError,
    MemoryBudgetError,
    ModelBusyError,
    ModelFetchError,
    ModelLoadError,
    NotAGenerativeModelError,
    NotAnEmbeddingModelError,
    SnapshotError,
)
from .generation.results import Chunk, GenerationResult, GenerationStats, TokenStream
from .generation.sampling import SamplingConfig
from .generation.state import PromptCache
from .loader import load
from .machine.inventory import DeviceInventory, devices
from .machine.policy import ProviderPlan, plan_providers
from .memory.plan import MemoryPlan
from .model import Model

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "ChatTemplateError",
    "Chunk",
    "ConversionError",
    "DeviceInventory",
    "EdgeInferError",
    "GenerationResult",
    "GenerationStats",
    "InvalidRequestError",
    "LoadConfig",
    "MemoryBudgetError",
    "MemoryPlan",
    "Model",
    "ModelBusyError",
    "ModelFetchError",
    "ModelLoadError",
    "NotAGenerativeModelError",
    "NotAnEmbeddingModelError",
    "PromptCache",
    "ProviderPlan",
    "SamplingConfig",
    "SnapshotError",
    "TokenStream",
    "__version__",
    "devices",
    "load",
    "plan_providers",
]
