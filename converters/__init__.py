"""Workstation-side tools that turn a model into files a device can run.

    from edgeinfer.converters import convert
    result = convert("model.gguf", "model-onnx", to="onnx", quant="int8")
    result.report["top1_agreement"]

Heavy dependencies (torch, optimum, transformers, onnx) are imported inside the functions
that need them, never at import time.
"""

from __future__ import annotations

from .config import ONNX_QUANTS, ConvertConfig
from .pipeline import ConversionResult, convert, convert_with

__all__ = ["ONNX_QUANTS", "ConversionResult", "ConvertConfig", "convert", "convert_with"]
