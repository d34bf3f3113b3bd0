"""Hugging Face folder (or GGUF, dequantized by transformers) -> ONNX folder through optimum:
read, export fp32, quantize, validate against transformers, atomically."""

from __future__ import annotations

import logging
import math
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

from ..atomic import atomic_output_dir, ensure_free_space
from ..config import ConvertConfig
from ..sources.checkpoint import check_source, checkpoint_from_gguf
from ..sources.safetensors_reader import open_checkpoint
from ..stages import ConversionResult, StageCallback, Stages, format_report, require_passed
from ..validate import validate_conversion
from . import export

__all__ = ["convert_optimum"]

_QUANT_BYTES = {"fp32": 4, "fp16": 2, "int8": 1, "int8wo": 1, "int4": 0.5}  # per weight


def convert_optimum(
    cfg: ConvertConfig, *, on_stage: StageCallback | None = None
) -> ConversionResult:
    checked = check_source(cfg.src, allow_pickle=cfg.allow_pickle)  # before anything is written
    if checked is not None:
        ensure_free_space(cfg.out, _onnx_bytes_needed(checked.folder, str(cfg.quant)))
    stage = Stages(on_stage, total=4)
    _quiet_libraries(cfg.threads)
    with atomic_output_dir(cfg.out, overwrite=cfg.overwrite) as partial, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        work = partial / "_work"
        stage(f"reading {cfg.src.name}")
        source = checked or checkpoint_from_gguf(cfg.src, work / "hf")
        stage("exporting to ONNX (fp32) with optimum")
        graph = export.export_onnx(source.folder, work / "export")
        stage(f"quantizing to {cfg.quant}")
        quantization = export.quantize_onnx(graph, partial / "model.onnx", cfg)
        manifest = export.write_model_folder(work / "export", partial, source, quantization)
        stage("validating against the source")
        report = validate_conversion(source.folder, partial, manifest, cfg)
        manifest = replace(manifest, validation=report)
        manifest.write(partial)
        shutil.rmtree(work)
        require_passed(report, cfg.out)
        stage.done(format_report(report))
    return ConversionResult(cfg.out, manifest, report)


def _onnx_bytes_needed(checkpoint: Path, quant: str) -> int:
    """Disk space the ONNX route needs at its peak: the fp32 export and the quantized graph
    side by side (bytes per weight below), plus the tokenizer files."""
    if not any(checkpoint.glob("*.safetensors")):
        return 0  # pickle weights: not measured
    with open_checkpoint(checkpoint) as index:
        weights = sum(math.prod(e.shape) for e in index.entries.values())
    extra = sum(p.stat().st_size for p in checkpoint.glob("tokenizer*.json"))
    return int(weights * (4 + _QUANT_BYTES.get(quant, 4))) + extra


def _quiet_libraries(threads: int | None) -> None:
    """Keep transformers/optimum chatter out of the user's terminal; set torch's threads."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("optimum").setLevel(logging.ERROR)
    if threads:
        torch.set_num_threads(threads)
