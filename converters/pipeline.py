"""The dispatcher: ``convert`` reads the options into a ConvertConfig and hands it to its route.

Routes: ``gguf/route.py`` (to a GGUF file), ``onnx/native.py`` (to an ONNX folder with the
native builder) and ``onnx/optimum.py`` (to an ONNX folder through optimum). Each is imported
when it is chosen, so a conversion loads only its own route.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError

from .config import ConvertConfig
from .stages import ConversionResult, StageCallback

__all__ = ["ConversionResult", "convert", "convert_with"]


def convert(
    src: str | PathLike[str],
    out: str | PathLike[str],
    *,
    to: str | None = None,
    quant: str | None = None,
    overwrite: bool = False,
    on_stage: StageCallback | None = None,
    **options: Any,
) -> ConversionResult:
    """Convert ``src`` (a .gguf file or a Hugging Face folder) into ``out``: an ONNX model
    folder (``to="onnx"``) or one GGUF file (``to="gguf"``, f16 by default; a GGUF ``src`` is
    quantized with llama.cpp's quantizer). ``to`` follows ``out``'s suffix when omitted.

    A GGUF ``src`` goes to ONNX through the native builder (``builder="native"``, no torch):
    ``quant="keep"`` (the default) keeps its blocks exactly. A Hugging Face folder goes
    through optimum (``quant`` int8 by default).

    The result is validated against the source; below the thresholds in ``options``
    (``min_top1_agreement``, ``min_greedy_agreement``) ConversionError is raised and nothing is
    written. ``out`` appears only when everything succeeded.
    """
    try:
        cfg = ConvertConfig(
            Path(src), Path(out), to=to, quant=quant, overwrite=overwrite, **options
        )
    except TypeError as exc:
        raise ConversionError(f"unknown conversion option: {exc}") from exc
    return convert_with(cfg, on_stage=on_stage)


def convert_with(cfg: ConvertConfig, *, on_stage: StageCallback | None = None) -> ConversionResult:
    """Run the route ``cfg`` names: GGUF output, the native ONNX builder, or optimum."""
    if cfg.to == "gguf":
        from .gguf.route import convert_gguf

        return convert_gguf(cfg, on_stage=on_stage)
    if cfg.builder == "native":
        from .onnx.native import convert_native

        return convert_native(cfg, on_stage=on_stage)
    from .onnx.optimum import convert_optimum

    return convert_optimum(cfg, on_stage=on_stage)
