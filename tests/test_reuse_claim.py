"""Prompt reuse is claimed exact only where it was shown: the CPU (issue 28).

Read whole or in two parts, a prompt gives bit-identical logits on the CPU kernels
(tests/test_backend_conformance.py); no GPU or NPU kernel was compared, so there the
generator reads every prompt whole. The claim is a property of each backend, checked here
on backends given only the facts it reads.
"""

from __future__ import annotations

from typing import Any

import pytest


def _backend(cls: type, **fields: Any) -> Any:
    backend = object.__new__(cls)  # no engine: only the facts reuse_is_exact reads
    for name, value in fields.items():
        setattr(backend, name, value)
    return backend


@pytest.mark.parametrize(
    ("provider", "exact"),
    [
        ("CPUExecutionProvider", True),
        ("CUDAExecutionProvider", False),
        ("QNNExecutionProvider", False),
        ("CoreMLExecutionProvider", False),
        ("DmlExecutionProvider", False),
    ],
)
def test_onnx_runtime_claims_exact_reuse_on_the_cpu_only(provider: str, exact: bool) -> None:
    pytest.importorskip("onnxruntime")
    from edgeinfer.runtimes.onnxruntime import OrtBackend

    assert _backend(OrtBackend, _info={"provider": provider}).reuse_is_exact is exact


@pytest.mark.parametrize(
    ("n_gpu_layers", "flash_attention", "exact"),
    [(0, False, True), (0, True, False), (99, False, False), (-1, False, False)],
)
def test_llama_cpp_claims_exact_reuse_on_the_cpu_without_flash_attention(
    n_gpu_layers: int, flash_attention: bool, exact: bool
) -> None:
    from edgeinfer.runtimes.llama_cpp import LlamaCppBackend

    backend = _backend(
        LlamaCppBackend, _info={"n_gpu_layers": n_gpu_layers}, _flash_attention=flash_attention
    )
    assert backend.reuse_is_exact is exact
