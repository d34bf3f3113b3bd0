"""The source of a conversion, as a Hugging Face checkpoint folder on disk.

A ``.gguf`` file is dequantized with transformers' GGUF loader into a temporary checkpoint;
its tokenizer settings (BOS/EOS, add-BOS) are taken from the GGUF header, which is the
authority for how llama.cpp tokenizes. A Hugging Face folder is used as it is, if its weights
are safetensors; pickle weights (``.bin``, ``.pt``) can run code when loaded and are refused
unless the user allows them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import ConversionError, EdgeInferError
from edgeinfer.files.gguf_checks import check_gguf_model
from edgeinfer.files.gguf_file import GGUF_MAGIC, read_gguf_header

from .hf_config import read_model_config
from .safetensors_reader import open_checkpoint

__all__ = [
    "SourceCheckpoint",
    "check_source",
    "checkpoint_from_gguf",
    "file_sha256",
    "prepare_source",
]

logger = logging.getLogger(__name__)

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>")


@dataclass(frozen=True)
class SourceCheckpoint:
    folder: Path  # a Hugging Face checkpoint (config.json, safetensors, tokenizer files)
    kind: str  # "gguf" | "hf"
    path: Path  # what the user named
    sha256: str  # of the GGUF file, or of the weight files in name order


def file_sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def check_source(src: Path, *, allow_pickle: bool) -> SourceCheckpoint | None:
    """Check ``src`` without writing anything: a Hugging Face folder is returned as it is
    (config.json, weights and tokenizer checked); a GGUF file gives None (it is dequantized
    by ``prepare_source``). Anything else is a ConversionError."""
    if not src.exists():
        raise ConversionError(f"{src}: no such file or folder")
    if src.is_dir():
        return _from_hf_folder(src, allow_pickle=allow_pickle)
    try:
        with src.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ConversionError(f"cannot read {src}: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise ConversionError(f"{src} is neither a GGUF file nor a Hugging Face model folder")
    return None


def prepare_source(src: Path, work: Path, *, allow_pickle: bool) -> SourceCheckpoint:
    checked = check_source(src, allow_pickle=allow_pickle)
    return checked or checkpoint_from_gguf(src, work / "hf")


def _from_hf_folder(folder: Path, *, allow_pickle: bool) -> SourceCheckpoint:
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder} has no config.json: not a Hugging Face model folder")
    read_model_config(folder / "config.json")
    safetensors = sorted(folder.glob("*.safetensors"))
    pickles = sorted(p for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if not safetensors and pickles and not allow_pickle:
        raise ConversionError(
            f"{folder} stores its weights as pickle ({pickles[0].name}), which can run code "
            "when loaded; convert it to safetensors, or pass --allow-pickle if you trust it"
        )
    weights = safetensors or pickles
    if not weights:
        raise ConversionError(f"{folder} has no weights (*.safetensors)")
    if safetensors:
        with open_checkpoint(folder):  # every header checked before torch reads the files
            pass
    if not (folder / "tokenizer.json").is_file():
        raise ConversionError(f"{folder} has no tokenizer.json (a fast tokenizer is needed)")
    try:
        digest = file_sha256(weights)
    except OSError as exc:
        raise ConversionError(f"cannot read the weights of {folder}: {exc}") from exc
    return SourceCheckpoint(folder, "hf", folder, digest)


def checkpoint_from_gguf(gguf: Path, out: Path) -> SourceCheckpoint:
    """Dequantize ``gguf`` into a Hugging Face checkpoint in ``out`` (fp32 safetensors)."""
    try:
        header = read_gguf_header(gguf)
        check_gguf_model(header, error=ConversionError)
    except ConversionError:
        raise
    except EdgeInferError as exc:
        raise ConversionError(f"cannot convert {gguf}: {exc}") from exc
    logger.info("dequantizing %s into a Hugging Face checkpoint", gguf.name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        raise ConversionError(
            f"transformers cannot read {gguf.name} (architecture {header.architecture!r}): {exc}"
        ) from exc
    _apply_gguf_tokenizer_settings(tokenizer, header.metadata)
    out.mkdir(parents=True, exist_ok=True)
    if model.generation_config is not None:
        model.generation_config.eos_token_id = _eos_ids(tokenizer, header.metadata)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return SourceCheckpoint(out, "gguf", gguf, file_sha256([gguf]))


def _apply_gguf_tokenizer_settings(tokenizer: object, meta: dict) -> None:
    """Make the Hugging Face tokenizer tokenize as llama.cpp does with the GGUF's settings."""
    from tokenizers import processors

    vocab = {i: t for t, i in tokenizer.get_vocab().items()}  # type: ignore[attr-defined]
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    if isinstance(bos_id, int) and bos_id in vocab:
        tokenizer.bos_token = vocab[bos_id]  # type: ignore[attr-defined]
    if isinstance(eos_id, int) and eos_id in vocab:
        tokenizer.eos_token = vocab[eos_id]  # type: ignore[attr-defined]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    backend = tokenizer.backend_tokenizer  # type: ignore[attr-defined]
    if not add_bos:
        tokenizer.add_bos_token = False  # type: ignore[attr-defined]
        backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")


def _eos_ids(tokenizer: object, meta: dict) -> list[int]:
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    ids += [vocab.get(t) for t in _END_OF_TURN]
    return sorted({int(i) for i in ids if isinstance(i, int)})
