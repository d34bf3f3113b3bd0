"""Workstation-side tools that turn a model into files a device can run.

    from edgeinfer.converters import convert
    result = convert("model.gguf", "model-onnx", to="onnx", quant="int8")
    result.report["top1_agreement"]

``pipeline.py`` picks the route for a ConvertConfig (``config.py``): ``gguf/`` writes a GGUF
file, ``onnx/`` an ONNX folder (native builder or optimum). The routes share ``stages.py``
(result, stage lines, report), ``sources/`` (what is read), ``validate.py`` (every check that
the result still answers like its source) and ``atomic.py`` (output appears whole or not at all).

Heavy dependencies (torch, optimum, transformers, onnx) are imported inside the functions
that need them, never at import time.
"""

from __future__ import annotations

from .config import ONNX_QUANTS, ConvertConfig
from .pipeline import convert, convert_with
from .stages import ConversionResult

__all__ = ["ONNX_QUANTS", "ConversionResult", "ConvertConfig", "convert", "convert_with"]
