"""A GGUF file as an ONNX model folder: the native builder's graph, the vocabulary as
``tokenizer.json`` (and the chat template), and ``edgeinfer.json``.

The loader calls this for a catalog GGUF it runs through ONNX Runtime; ``native.py`` calls it
inside a conversion, then validates. Nothing here loads a model, so nothing here imports the
loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeinfer.files.manifest import Architecture, Manifest

from ..sources.checkpoint import file_sha256
from .builder import BuildReport, build_onnx_from_gguf
from .vocab import (
    GGUFVocabulary,
    checked_tokenizer_json,
    read_gguf_vocabulary,
    write_tokenizer_files,
)

__all__ = ["write_gguf_folder"]


def write_gguf_folder(
    src: str | Path,
    folder: str | Path,
    *,
    quant: str = "keep",
    head_bits: int | None = None,
    max_context: int | None = None,
    kv_dtype: str = "float32",
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
        kv_dtype=kv_dtype,
        on_progress=on_progress,
    )
    write_tokenizer_files(vocab, folder, document)
    manifest = _manifest(src, vocab, report, quant)
    manifest.write(folder)
    return manifest, report


def _manifest(src: Path, vocab: GGUFVocabulary, report: BuildReport, quant: str) -> Manifest:
    shape = report.shape
    return Manifest(
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
            kv_dtype=report.kv_dtype,
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
