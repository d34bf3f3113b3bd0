"""GGUF conversions: Hugging Face folder -> GGUF (f32/f16/bf16/q8_0 written directly, the
llama.cpp quantizations from an f16 intermediate), or GGUF -> quantized GGUF; each checked
(tokenizer, then answers against the source) before OUT appears."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError, EdgeInferError, ModelLoadError
from edgeinfer.files.gguf_checks import check_gguf_model
from edgeinfer.files.gguf_file import GGUF_MAGIC, read_gguf_header

from ..atomic import atomic_output_file
from ..config import ConvertConfig
from ..sources.hf_config import read_model_config
from ..stages import ConversionResult, StageCallback, Stages, format_report, require_passed
from ..validate import validate_gguf
from .writer import LLAMA_QUANTS, WRITER_TYPES, gguf_architecture, quantize_gguf, write_gguf

__all__ = ["convert_gguf", "sidecar_path"]


def sidecar_path(out: Path) -> Path:
    """Where the validation report of ``out`` is written: ``OUT.json`` beside it."""
    return out.with_name(out.name + ".json")


def convert_gguf(cfg: ConvertConfig, *, on_stage: StageCallback | None = None) -> ConversionResult:
    quant = str(cfg.quant)
    from_gguf = _is_gguf(cfg.src)
    if from_gguf and quant not in LLAMA_QUANTS:
        raise ConversionError(
            f"a GGUF source can be quantized ({', '.join(LLAMA_QUANTS)}), not converted to "
            f"{quant}; give a Hugging Face folder for {quant}"
        )
    if from_gguf:  # refused before anything is written or started
        _check_gguf_source(cfg.src)
    else:
        _check_checkpoint(cfg.src)
    needs_f16 = not from_gguf and quant not in WRITER_TYPES
    stage = Stages(on_stage, total=2 + int(needs_f16))
    with atomic_output_file(cfg.out, overwrite=cfg.overwrite) as partial:
        intermediate = partial.with_name(partial.name + ".f16")
        try:
            if from_gguf:
                stage(f"quantizing {cfg.src.name} to {quant} with llama.cpp")
                done = quantize_gguf(cfg.src, partial, quant, threads=cfg.threads,
                                     progress=stage.detail)  # fmt: skip
            elif needs_f16:
                stage(f"writing {cfg.src.name} as GGUF f16")
                write_gguf(cfg.src, intermediate, "f16", progress=stage.detail)
                stage(f"quantizing to {quant} with llama.cpp")
                done = quantize_gguf(intermediate, partial, quant, threads=cfg.threads,
                                     progress=stage.detail)  # fmt: skip
            else:
                stage(f"writing {cfg.src.name} as GGUF {quant}")
                done = write_gguf(cfg.src, partial, quant, progress=stage.detail)
        finally:
            intermediate.unlink(missing_ok=True)
        stage("checking the tokenizer and the answers against the source")
        report = _validate(cfg, partial, from_gguf)
        report["conversion"] = done
        require_passed(report, cfg.out)
        # the report goes in place just before OUT: a failure up to here leaves neither
        _write_json(sidecar_path(cfg.out), report)
    summary = format_report(report) if "top1_agreement" in report else report["skipped"]
    stage.detail(f"done: {cfg.out} ({cfg.out.stat().st_size / 1e6:.0f} MB); {summary}")
    return ConversionResult(cfg.out, None, report)


def _validate(cfg: ConvertConfig, result_path: Path, from_gguf: bool) -> dict[str, Any]:
    try:
        return validate_gguf(cfg, result_path, from_gguf)
    except ConversionError:
        raise
    except EdgeInferError as exc:  # the written file does not load: a conversion failure
        raise ConversionError(f"the converted model could not be checked: {exc}") from exc


def _check_checkpoint(src: Path) -> None:
    """Refuse a Hugging Face folder the writer cannot convert before anything is written."""
    if not src.exists():
        raise ConversionError(f"{src}: no such file or folder")
    if not src.is_dir():
        raise ConversionError(f"{src} is neither a GGUF file nor a Hugging Face model folder")
    gguf_architecture(read_model_config(src / "config.json"))


def _check_gguf_source(src: Path) -> None:
    try:
        check_gguf_model(read_gguf_header(src), error=ConversionError)
    except ModelLoadError as exc:
        raise ConversionError(f"cannot quantize {src.name}: {exc}") from exc


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError as exc:
        raise ConversionError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_output_file(path, overwrite=True) as partial:
        partial.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
