"""The native ONNX graph builder: a GGUF file (or a safetensors folder read as one) becomes an
onnxruntime decoder graph with contrib operators, no torch, transformers or optimum."""

from .build import QUANTS, SUPPORTED_ARCHITECTURES, BuildReport, build_onnx_from_gguf, gguf_shape

__all__ = ["QUANTS", "SUPPORTED_ARCHITECTURES", "BuildReport", "build_onnx_from_gguf", "gguf_shape"]
