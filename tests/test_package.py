"""The public surface: exports, error tree, and what `import edgeinfer` may load."""

from __future__ import annotations

import json
import subprocess
import sys

import edgeinfer

EXPECTED_ALL = {
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
}


def test_public_names_are_pinned() -> None:
    assert set(edgeinfer.__all__) == EXPECTED_ALL
    for name in edgeinfer.__all__:
        assert hasattr(edgeinfer, name), name


def test_every_error_derives_from_edgeinfer_error() -> None:
    for name in (
        "ModelLoadError",
        "ModelFetchError",
        "BackendUnavailableError",
        "MemoryBudgetError",
        "ModelBusyError",
        "ConversionError",
        "InvalidRequestError",
        "ChatTemplateError",
        "NotAnEmbeddingModelError",
        "NotAGenerativeModelError",
    ):
        assert issubclass(getattr(edgeinfer, name), edgeinfer.EdgeInferError), name
    assert issubclass(edgeinfer.ModelFetchError, edgeinfer.ModelLoadError)
    assert issubclass(edgeinfer.ChatTemplateError, edgeinfer.InvalidRequestError)
    assert issubclass(edgeinfer.NotAnEmbeddingModelError, edgeinfer.InvalidRequestError)
    assert issubclass(edgeinfer.NotAGenerativeModelError, edgeinfer.InvalidRequestError)


def test_import_loads_no_engine_or_converter() -> None:
    code = (
        "import sys, json, edgeinfer; "
        "print(json.dumps(sorted(m for m in ('torch', 'onnxruntime', 'llama_cpp', "
        "'transformers', 'optimum', 'onnx', 'jinja2') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_runtimes_and_converters_are_subpackages() -> None:
    import edgeinfer.converters
    import edgeinfer.runtimes
    from edgeinfer.runtimes import base

    assert "gguf" in edgeinfer.runtimes.BACKENDS
    assert hasattr(base, "Backend") and edgeinfer.converters.__doc__
