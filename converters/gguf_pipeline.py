"""GGUF conversions: Hugging Face folder -> GGUF (f32/f16/bf16/q8_0 written directly, the
llama.cpp quantizations from an f16 intermediate), or GGUF -> quantized GGUF; each checked
(tokenizer, then answers against the source) before OUT appears."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError, EdgeInferError
from edgeinfer.gguf_file import GGUF_MAGIC

from .atomic import atomic_output_file
from .config import ConvertConfig
from .gguf_export import (
    LLAMA_QUANTS,
    TOKENIZER_CHECK_TEXT,
    WRITER_TYPES,
    gguf_architecture,
    quantize_gguf,
    write_gguf,
)
from .hf_config import read_model_config
from .pipeline import ConversionResult, StageCallback, _Stages, format_report

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
    stage = _Stages(on_stage, total=2 + int(needs_f16))
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
        if not report.get("passed", True):
            raise ConversionError(
                f"validation failed, nothing written to {cfg.out}:\n{format_report(report)}"
            )
        # the report goes in place just before OUT: a failure up to here leaves neither
        _write_json(sidecar_path(cfg.out), report)
    summary = format_report(report) if "top1_agreement" in report else report["skipped"]
    stage.detail(f"done: {cfg.out} ({cfg.out.stat().st_size / 1e6:.0f} MB); {summary}")
    return ConversionResult(cfg.out, None, report)


def _validate(cfg: ConvertConfig, result_path: Path, from_gguf: bool) -> dict[str, Any]:
    try:
        return _validate_loaded(cfg, result_path, from_gguf)
    except ConversionError:
        raise
    except EdgeInferError as exc:  # the written file does not load: a conversion failure
        raise ConversionError(f"the converted model could not be checked: {exc}") from exc


def _validate_loaded(cfg: ConvertConfig, result_path: Path, from_gguf: bool) -> dict[str, Any]:
    import edgeinfer

    from .validate import ModelReference, TransformersReference, compare

    threads = cfg.threads
    with edgeinfer.load(result_path, device="cpu", context_length=256, threads=threads) as model:
        tokenizer = _check_tokenizer(cfg.src, model, from_gguf)
        if from_gguf:
            with edgeinfer.load(cfg.src, device="cpu", context_length=256, threads=threads) as src:
                report = compare(ModelReference(src), model, cfg)
            report["reference"] = f"{cfg.src.name} through llama.cpp"
        elif importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = compare(TransformersReference(cfg.src), model, cfg)
            report["reference"] = "the Hugging Face checkpoint through transformers (float32)"
        else:
            report = {
                "skipped": "answers not compared: the source checkpoint needs torch and "
                "transformers to run (pip install 'edgeinfer[convert]'); tokenizer checked",
            }
    report["tokenizer_check"] = tokenizer
    return report


def _check_tokenizer(src: Path, model: Any, from_gguf: bool) -> dict[str, Any]:
    """The GGUF's tokenizer must give the source tokenizer's ids on a mixed-script text."""
    if from_gguf:
        return {"checked": False, "why": "quantization keeps the source's vocabulary"}
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return {"checked": False, "why": "the tokenizers library is not installed"}

    expected = (
        Tokenizer.from_file(str(src / "tokenizer.json"))
        .encode(TOKENIZER_CHECK_TEXT, add_special_tokens=False)
        .ids
    )
    got = model.tokenize(TOKENIZER_CHECK_TEXT, add_special=False)
    if list(expected) != list(got):
        first = next(
            (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
            min(len(expected), len(got)),
        )
        raise ConversionError(
            f"the GGUF tokenizer disagrees with {src / 'tokenizer.json'} from token {first} on "
            f"a test text ({len(got)} vs {len(expected)} tokens); nothing was written"
        )
    return {"checked": True, "tokens": len(got)}


def _check_checkpoint(src: Path) -> None:
    """Refuse a Hugging Face folder the writer cannot convert before anything is written."""
    if not src.exists():
        raise ConversionError(f"{src}: no such file or folder")
    if not src.is_dir():
        raise ConversionError(f"{src} is neither a GGUF file nor a Hugging Face model folder")
    gguf_architecture(read_model_config(src / "config.json"))


def _check_gguf_source(src: Path) -> None:
    from edgeinfer.errors import ModelLoadError
    from edgeinfer.gguf_checks import check_gguf_model
    from edgeinfer.gguf_file import read_gguf_header

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
