"""To ONNX with the native builder (no torch, transformers or optimum): a GGUF file, checked
against llama.cpp on the same file, or a Hugging Face safetensors folder, checked against
transformers when torch is installed."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from edgeinfer.errors import BackendUnavailableError, ConversionError
from edgeinfer.files.gguf_file import read_gguf_header
from edgeinfer.files.manifest import Manifest
from edgeinfer.progress import Progress

from ..atomic import atomic_output_dir, ensure_free_space
from ..config import ConvertConfig
from ..sources.checkpoint import SourceCheckpoint, check_source
from ..sources.hf_config import read_model_config
from ..sources.hf_source import HF_ARCHITECTURES
from ..stages import ConversionResult, StageCallback, Stages, format_report, require_passed
from ..validate import check_against_llama_cpp, validate_native, validate_native_checkpoint
from .builder import build_onnx_from_gguf, gguf_shape
from .export import write_model_folder
from .folder import write_gguf_folder

__all__ = ["convert_native"]


def convert_native(
    cfg: ConvertConfig, *, on_stage: StageCallback | None = None
) -> ConversionResult:
    if cfg.src.is_dir():
        return _convert_checkpoint(cfg, on_stage)
    src = cfg.src
    header = read_gguf_header(src)
    gguf_shape(header)  # an unsupported or inconsistent model is refused before any writing
    ensure_free_space(cfg.out, _bytes_needed(header, str(cfg.quant)))
    stage = Stages(on_stage, total=3)
    with atomic_output_dir(cfg.out, overwrite=cfg.overwrite) as partial:
        stage(f"building the ONNX graph of {src.name} ({cfg.quant}, native builder)")
        bar = _TensorBar(stage)
        manifest, built = write_gguf_folder(
            src,
            partial,
            quant=str(cfg.quant),
            head_bits=cfg.head_bits,
            kv_dtype=cfg.kv_dtype,
            on_progress=bar,
        )
        bar.close()
        if built.widened:
            stage.detail(f"  widened to floats: {', '.join(sorted(built.widened))}")
        stage("checking the tokenizer against llama.cpp on the source")
        tokenizer = check_against_llama_cpp(src, partial)
        if tokenizer["checked_against"] is None:
            stage.detail("  llama-cpp-python is not installed: tokenizer ids not compared")
        tokenizer["stop_ids"] = _check_stop_set(src, manifest)
        stage("validating against llama.cpp on the source")
        report = validate_native(cfg, partial, manifest, on_prompt=_prompt_lines(stage))
        report["tokenizer_check"] = tokenizer
        manifest = _finish(cfg, partial, manifest, report, stage)
    return ConversionResult(cfg.out, manifest, report)


def _check_stop_set(src: Path, manifest: Manifest) -> dict[str, Any]:
    """The folder's stop set (``eos_token_ids``) against llama.cpp's end-of-generation set on
    ``src``, asked of llama.cpp for every id; ConversionError when they differ (the folder
    would stop where the source does not, or run past where it stops)."""
    ours = tuple(manifest.eos_token_ids)
    theirs = llama_cpp_stop_ids(src)
    if theirs is None:
        return {"ids": list(ours), "checked_against": None}
    if theirs != ours:
        extra, missing = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        differences = ([f"stop on tokens {extra}"] if extra else []) + (
            [f"run past tokens {missing}"] if missing else []
        )
        raise ConversionError(
            f"{src.name}: the folder would {' and '.join(differences)}, unlike llama.cpp on "
            "the source; report this vocabulary, or convert with --builder optimum"
        )
    return {"ids": list(ours), "checked_against": "llama.cpp"}


def llama_cpp_stop_ids(gguf: Path) -> tuple[int, ...] | None:
    """Every id llama.cpp ends a generation on in ``gguf``'s vocabulary (``llama_vocab_is_eog``
    for each), sorted; None without llama-cpp-python."""
    from edgeinfer.runtimes.llama_cpp import engine

    try:
        llama_cpp = engine()
    except BackendUnavailableError:
        return None
    try:
        ref = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    except ValueError as exc:  # llama-cpp-python: "Failed to load model from file"
        raise ConversionError(f"{gguf.name}: llama.cpp cannot read its vocabulary: {exc}") from exc
    try:
        vocab = llama_cpp.llama_model_get_vocab(ref.model)
        n = int(llama_cpp.llama_vocab_n_tokens(vocab))
        return tuple(i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i))
    finally:
        ref.close()


def _convert_checkpoint(cfg: ConvertConfig, on_stage: StageCallback | None) -> ConversionResult:
    """A Hugging Face safetensors folder through the native builder; validated against
    transformers on the same folder when torch is installed."""
    source = _checked_checkpoint(cfg)
    params = sum(p.stat().st_size for p in source.folder.glob("*.safetensors"))
    ensure_free_space(cfg.out, params * 2 if cfg.quant in ("keep", "fp32") else params)
    stage = Stages(on_stage, total=2)
    with atomic_output_dir(cfg.out, overwrite=cfg.overwrite) as partial:
        stage(f"building the ONNX graph of {cfg.src.name} ({cfg.quant}, native builder)")
        manifest = _write_checkpoint_folder(cfg, source, partial, _TensorBar(stage))
        stage("validating against the source through transformers (float32)")
        report = validate_native_checkpoint(
            cfg, source.folder, partial, manifest, on_prompt=_prompt_lines(stage)
        )
        manifest = _finish(cfg, partial, manifest, report, stage)
    return ConversionResult(cfg.out, manifest, report)


def _checked_checkpoint(cfg: ConvertConfig) -> SourceCheckpoint:
    source = check_source(cfg.src, allow_pickle=False)
    if source is None:  # pragma: no cover - a folder is never a GGUF
        raise ConversionError(f"{cfg.src} is not a Hugging Face model folder")
    hp = read_model_config(source.folder / "config.json")
    if hp.model_type not in HF_ARCHITECTURES:
        raise ConversionError(
            f"{cfg.src}: model_type {hp.model_type!r} is not supported by the native ONNX "
            f"builder (supported: {', '.join(sorted(HF_ARCHITECTURES))}); use --builder optimum"
        )
    return source


def _write_checkpoint_folder(
    cfg: ConvertConfig, source: SourceCheckpoint, partial: Path, bar: _TensorBar
) -> Manifest:
    """The graph, tokenizer files and manifest of the checkpoint ``source`` in ``partial``."""
    built = build_onnx_from_gguf(
        source.folder,
        partial,
        quant=str(cfg.quant),
        head_bits=cfg.head_bits,
        kv_dtype=cfg.kv_dtype,
        on_progress=bar,
    )
    bar.close()
    method = {"method": "float" if cfg.quant in ("keep", "fp32") else str(cfg.quant)}
    written = write_model_folder(source.folder, partial, source, method)
    manifest = dataclasses.replace(
        written,
        architecture=dataclasses.replace(
            written.architecture,
            kv_cache="shared",
            max_context=built.max_context,
            kv_dtype=built.kv_dtype,
        ),
        has_position_ids=False,
        quantization={**method, "builder": "native", "nbits": built.nbits},
    )
    manifest.write(partial)
    return manifest


def _finish(
    cfg: ConvertConfig, partial: Path, manifest: Manifest, report: dict[str, Any], stage: Stages
) -> Manifest:
    """Record ``report`` in the manifest; refuse a failed validation (nothing is written)."""
    manifest = dataclasses.replace(manifest, validation=report)
    manifest.write(partial)
    require_passed(report, cfg.out)
    stage.done(format_report(report) if "skipped" not in report else report["skipped"])
    return manifest


def _prompt_lines(stage: Stages) -> Any:
    return lambda i, n: stage.detail(f"  prompt {i}/{n}")


def _bytes_needed(header: Any, quant: str) -> int:
    """The graph's data file at its largest: 5-bit blocks are stored in 8 bits (x1.6 of the
    GGUF at worst), int8 about the same, fp32 four bytes a weight."""
    if quant == "fp32":
        weights = sum(math.prod(t.shape) for t in header.tensors)
        return 4 * weights
    return int(header.weight_nbytes * 1.7)


class _TensorBar:
    """Tensors written / total: a bar on a terminal, a line per quarter otherwise."""

    def __init__(self, stage: Stages) -> None:
        self._stage = stage
        self._bar: Any = None
        self._quarter = 0
        self._tty = os.isatty(2)

    def __call__(self, done: int, total: int) -> None:
        if self._tty:
            if self._bar is None:
                self._bar = Progress("  tensors", total, unit="tensors")
            self._bar.advance(1)
        elif done * 4 >= (self._quarter + 1) * total:
            self._quarter = done * 4 // total
            self._stage.detail(f"  tensors written: {done}/{total}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
