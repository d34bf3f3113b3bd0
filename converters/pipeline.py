"""The conversion pipeline: source -> export -> quantize -> package -> validate, atomically."""

from __future__ import annotations

import logging
import math
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from os import PathLike
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError
from edgeinfer.manifest import Manifest

from .atomic import atomic_output_dir, ensure_free_space
from .config import ConvertConfig

__all__ = ["ConversionResult", "convert", "convert_with", "format_report"]

logger = logging.getLogger(__name__)

StageCallback = Callable[[str], None]
_STAGES = 4
_QUANT_BYTES = {"fp32": 4, "fp16": 2, "int8": 1, "int8wo": 1, "int4": 0.5}  # per weight


@dataclass(frozen=True)
class ConversionResult:
    path: Path
    manifest: Manifest | None  # ONNX folders; None for a GGUF file
    report: dict[str, Any]


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
    if cfg.to == "gguf":
        from .gguf_pipeline import convert_gguf

        return convert_gguf(cfg, on_stage=on_stage)
    if cfg.builder == "native":
        from .native_pipeline import convert_native

        return convert_native(cfg, on_stage=on_stage)
    from .onnx_export import export_onnx, quantize_onnx, write_model_folder
    from .source import check_source, checkpoint_from_gguf
    from .validate import validate_conversion

    checked = check_source(cfg.src, allow_pickle=cfg.allow_pickle)  # before anything is written
    if checked is not None:
        ensure_free_space(cfg.out, _onnx_bytes_needed(checked.folder, str(cfg.quant)))
    stage = _Stages(on_stage)
    _quiet_libraries(cfg.threads)
    with atomic_output_dir(cfg.out, overwrite=cfg.overwrite) as partial, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        work = partial / "_work"
        stage(f"reading {cfg.src.name}")
        source = checked or checkpoint_from_gguf(cfg.src, work / "hf")
        stage("exporting to ONNX (fp32) with optimum")
        graph = export_onnx(source.folder, work / "export")
        stage(f"quantizing to {cfg.quant}")
        quantization = quantize_onnx(graph, partial / "model.onnx", cfg)
        manifest = write_model_folder(work / "export", partial, source, quantization)
        stage("validating against the source")
        report = validate_conversion(source.folder, partial, manifest, cfg)
        manifest = replace(manifest, validation=report)
        manifest.write(partial)
        shutil.rmtree(work)
        if not report["passed"]:
            raise ConversionError(
                f"validation failed, nothing written to {cfg.out}:\n{format_report(report)}"
            )
        stage.done(format_report(report))
    return ConversionResult(cfg.out, manifest, report)


def _onnx_bytes_needed(checkpoint: Path, quant: str) -> int:
    """Disk space the ONNX route needs at its peak: the fp32 export and the quantized graph
    side by side (bytes per weight below), plus the tokenizer files."""
    from .safetensors_reader import open_checkpoint

    if not any(checkpoint.glob("*.safetensors")):
        return 0  # pickle weights: not measured
    with open_checkpoint(checkpoint) as index:
        weights = sum(math.prod(e.shape) for e in index.entries.values())
    extra = sum(p.stat().st_size for p in checkpoint.glob("tokenizer*.json"))
    return int(weights * (4 + _QUANT_BYTES.get(quant, 4))) + extra


def format_report(report: dict[str, Any]) -> str:
    t = report["thresholds"]
    lines = [
        f"top-1 agreement {report['top1_agreement']:.1%} (min {t['top1']:.0%}), "
        f"greedy agreement {report['greedy_agreement']:.1%} (min {t['greedy']:.0%}), "
        f"mean KL {report['mean_kl']:.4f} over {report['positions']} positions of "
        f"{report['prompts']} prompts"
    ]
    for row in report["per_prompt"]:
        if row["greedy_fraction"] < 1.0:
            lines.append(
                f"  differs: {row['prompt']!r}: source {row['source_text']!r}, "
                f"result {row['result_text']!r}"
            )
    return "\n".join(lines)


class _Stages:
    def __init__(self, callback: StageCallback | None, total: int = _STAGES) -> None:
        self._callback = callback or (lambda line: logger.info("%s", line))
        self._n = 0
        self._total = total
        self._start = time.perf_counter()

    def __call__(self, what: str) -> None:
        self._n += 1
        elapsed = time.perf_counter() - self._start
        self._callback(f"[{self._n}/{self._total}] {what} ({elapsed:.0f} s so far)")

    def detail(self, line: str) -> None:
        self._callback(line)

    def done(self, summary: str) -> None:
        elapsed = time.perf_counter() - self._start
        self._callback(f"done in {elapsed:.0f} s: {summary}")


def _quiet_libraries(threads: int | None) -> None:
    """Keep transformers/optimum chatter out of the user's terminal; set torch's threads."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("optimum").setLevel(logging.ERROR)
    if threads:
        torch.set_num_threads(threads)
