"""GGUF -> ONNX with the native builder: graph, tokenizer and manifest from the GGUF alone,
checked against llama.cpp on the same file. No torch, transformers or optimum."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError, EdgeInferError
from edgeinfer.gguf_file import read_gguf_header
from edgeinfer.manifest import Architecture, Manifest

from .atomic import atomic_output_dir, ensure_free_space
from .config import ConvertConfig
from .gguf_vocab import (
    check_against_llama_cpp,
    checked_tokenizer_json,
    read_gguf_vocabulary,
    write_tokenizer_files,
)
from .onnx.builder import BuildReport, build_onnx_from_gguf, gguf_shape
from .source import file_sha256

__all__ = ["convert_native", "write_gguf_folder"]

logger = logging.getLogger(__name__)


def write_gguf_folder(
    src: str | Path,
    folder: str | Path,
    *,
    quant: str = "keep",
    head_bits: int | None = None,
    max_context: int | None = None,
    on_progress: Any = None,
) -> tuple[Manifest, BuildReport]:
    """Fill the existing, empty ``folder`` with the graph of the GGUF ``src``, its
    ``tokenizer.json`` and chat template, and ``edgeinfer.json``."""
    src, folder = Path(src), Path(folder)
    vocab = read_gguf_vocabulary(src)  # before the graph: a refused vocabulary costs nothing
    document = checked_tokenizer_json(vocab, src.name)
    report = build_onnx_from_gguf(
        src,
        folder,
        quant=quant,
        head_bits=head_bits,
        max_context=max_context,
        on_progress=on_progress,
    )
    write_tokenizer_files(vocab, folder, document)
    shape = report.shape
    manifest = Manifest(
        format="onnx",
        model_file="model.onnx",
        architecture=Architecture(
            model_type=report.architecture,
            num_layers=shape.layers,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            hidden_size=shape.hidden,
            max_context=report.max_context,
            vocab_size=shape.vocab,
            kv_cache="shared",
        ),
        chat_template_file="chat_template.jinja" if vocab.chat_template else None,
        bos_token=vocab.token(vocab.bos_id),
        eos_token=vocab.token(vocab.eos_id),
        eos_token_ids=vocab.eog_ids,
        has_position_ids=False,
        source={"kind": "gguf", "path": str(src), "sha256": file_sha256([src])},
        quantization={
            "method": "gguf-blocks" if quant == "keep" else quant,
            "builder": "native",
            "nbits": report.nbits,
            "widened": report.widened,
            "tokenizer": vocab.summary(),
        },
    )
    manifest.write(folder)
    return manifest, report


def convert_native(cfg: ConvertConfig, *, on_stage: Any = None) -> Any:
    if cfg.src.is_dir():
        return _convert_checkpoint(cfg, on_stage)
    from .pipeline import ConversionResult, _Stages

    src = cfg.src
    header = read_gguf_header(src)
    gguf_shape(header)  # an unsupported or inconsistent model is refused before any writing
    ensure_free_space(cfg.out, _bytes_needed(header, str(cfg.quant)))
    stage = _Stages(on_stage, total=3)
    with atomic_output_dir(cfg.out, overwrite=cfg.overwrite) as partial:
        stage(f"building the ONNX graph of {src.name} ({cfg.quant}, native builder)")
        bar = _TensorBar(stage)
        manifest, built = write_gguf_folder(
            src, partial, quant=str(cfg.quant), head_bits=cfg.head_bits, on_progress=bar
        )
        bar.close()
        if built.widened:
            stage.detail(f"  widened to floats: {', '.join(sorted(built.widened))}")
        stage("checking the tokenizer against llama.cpp on the source")
        tokenizer = check_against_llama_cpp(src, partial)
        if tokenizer["checked_against"] is None:
            stage.detail("  llama-cpp-python is not installed: tokenizer ids not compared")
        stage("validating against llama.cpp on the source")
        report = _validate(cfg, partial, manifest, stage)
        report["tokenizer_check"] = tokenizer
        manifest = replace(manifest, validation=report)
        manifest.write(partial)
        _finish(cfg, report, stage)
    return ConversionResult(cfg.out, manifest, report)


def _convert_checkpoint(cfg: ConvertConfig, on_stage: Any) -> Any:
    """A Hugging Face safetensors folder through the native builder; validated against
    transformers on the same folder when torch is installed."""
    import dataclasses

    from .hf_config import read_model_config
    from .hf_source import HF_ARCHITECTURES
    from .onnx_export import write_model_folder
    from .pipeline import ConversionResult, _Stages
    from .source import check_source

    source = check_source(cfg.src, allow_pickle=False)
    assert source is not None  # a folder
    hp = read_model_config(source.folder / "config.json")
    if hp.model_type not in HF_ARCHITECTURES:
        raise ConversionError(
            f"{cfg.src}: model_type {hp.model_type!r} is not supported by the native ONNX "
            f"builder (supported: {', '.join(sorted(HF_ARCHITECTURES))}); use --builder optimum"
        )
    params = sum(p.stat().st_size for p in source.folder.glob("*.safetensors"))
    ensure_free_space(cfg.out, params * 2 if cfg.quant in ("keep", "fp32") else params)
    stage = _Stages(on_stage, total=2)
    with atomic_output_dir(cfg.out, overwrite=cfg.overwrite) as partial:
        stage(f"building the ONNX graph of {cfg.src.name} ({cfg.quant}, native builder)")
        bar = _TensorBar(stage)
        built = build_onnx_from_gguf(
            source.folder, partial, quant=str(cfg.quant), head_bits=cfg.head_bits, on_progress=bar
        )
        bar.close()
        method = {"method": "float" if cfg.quant in ("keep", "fp32") else str(cfg.quant)}
        written = write_model_folder(source.folder, partial, source, method)
        manifest = dataclasses.replace(
            written,
            architecture=dataclasses.replace(
                written.architecture, kv_cache="shared", max_context=built.max_context
            ),
            has_position_ids=False,
            quantization={**method, "builder": "native", "nbits": built.nbits},
        )
        manifest.write(partial)
        stage("validating against the source through transformers (float32)")
        report = _validate_checkpoint(cfg, source.folder, partial, manifest, stage)
        manifest = replace(manifest, validation=report)
        manifest.write(partial)
        _finish(cfg, report, stage)
    return ConversionResult(cfg.out, manifest, report)


def _validate_checkpoint(
    cfg: ConvertConfig, checkpoint: Path, folder: Path, manifest: Manifest, stage: Any
) -> dict[str, Any]:
    import importlib.util

    if not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")):
        return {
            "skipped": "answers not compared: the source checkpoint needs torch and "
            "transformers to run (pip install 'edgeinfer[convert]')"
        }
    import warnings

    from .validate import TransformersReference, compare, open_result

    with warnings.catch_warnings(), open_result(folder, manifest, cfg.threads) as model:
        warnings.simplefilter("ignore")
        report = compare(
            TransformersReference(checkpoint),
            model,
            cfg,
            on_prompt=lambda i, n: stage.detail(f"  prompt {i}/{n}"),
        )
    report["reference"] = "the Hugging Face checkpoint through transformers (float32)"
    return report


def _finish(cfg: ConvertConfig, report: dict[str, Any], stage: Any) -> None:
    from .pipeline import format_report

    if report.get("passed") is False:
        raise ConversionError(
            f"validation failed, nothing written to {cfg.out}:\n{format_report(report)}"
        )
    stage.done(format_report(report) if "skipped" not in report else report["skipped"])


def _validate(cfg: ConvertConfig, folder: Path, manifest: Manifest, stage: Any) -> dict[str, Any]:
    import edgeinfer
    from edgeinfer.loader import llama_cpp_installed

    from .validate import ModelReference, compare, open_result

    if not llama_cpp_installed():
        return {
            "skipped": "answers not compared: llama.cpp, the reference for a GGUF source, is "
            "not installed (pip install 'edgeinfer[gguf]')"
        }

    try:
        with (
            open_result(folder, manifest, cfg.threads) as model,
            edgeinfer.load(cfg.src, device="cpu", context_length=256, threads=cfg.threads) as ref,
        ):
            report = compare(
                ModelReference(ref),
                model,
                cfg,
                on_prompt=lambda i, n: stage.detail(f"  prompt {i}/{n}"),
            )
    except ConversionError:
        raise
    except EdgeInferError as exc:  # the written folder does not load: a conversion failure
        raise ConversionError(f"the converted model could not be checked: {exc}") from exc
    report["reference"] = f"{cfg.src.name} through llama.cpp"
    return report


def _bytes_needed(header: Any, quant: str) -> int:
    """The graph's data file at its largest: 5-bit blocks are stored in 8 bits (x1.6 of the
    GGUF at worst), int8 about the same, fp32 four bytes a weight."""
    if quant == "fp32":
        weights = sum(math.prod(t.shape) for t in header.tensors)
        return 4 * weights
    return int(header.weight_nbytes * 1.7)


class _TensorBar:
    """Tensors written / total: a bar on a terminal, a line per quarter otherwise."""

    def __init__(self, stage: Any) -> None:
        from edgeinfer._progress import Progress

        self._stage = stage
        self._bar: Any = None
        self._Progress = Progress
        self._quarter = 0
        self._tty = os.isatty(2)

    def __call__(self, done: int, total: int) -> None:
        if self._tty:
            if self._bar is None:
                self._bar = self._Progress("  tensors", total, unit="tensors")
            self._bar.advance(1)
        elif done * 4 >= (self._quarter + 1) * total:
            self._quarter = done * 4 // total
            self._stage.detail(f"  tensors written: {done}/{total}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
