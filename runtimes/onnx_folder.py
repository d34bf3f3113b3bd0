"""An ONNX model folder's files, checked before a session opens: the graph and every external
data file it names inside the folder, the tokenizer (no larger than the graph's vocabulary)
and the chat template (bounded, UTF-8)."""

from __future__ import annotations

from pathlib import Path

from edgeinfer.bounded_json import read_regular_file
from edgeinfer.errors import ModelLoadError
from edgeinfer.files.manifest import MANIFEST_NAME, Architecture, Manifest, resolve_inside

from ..files.onnx_graph import GraphFacts, read_graph_facts
from .tokenizer_json import JsonTokenizer

__all__ = ["model_path_of", "open_tokenizer"]

_MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few KB


def open_tokenizer(folder: Path, manifest: Manifest) -> JsonTokenizer:
    arch = manifest.architecture
    tokenizer = JsonTokenizer(
        _regular_file(folder, manifest.tokenizer_file, "tokenizer_file"),
        eos_token_ids=manifest.eos_token_ids,
        bos_token=manifest.bos_token,
        eos_token=manifest.eos_token,
        chat_template=_read_optional(folder, manifest.chat_template_file),
        n_vocab=arch.vocab_size,
    )
    _check_tokenizer_size(tokenizer, folder / manifest.tokenizer_file, arch)
    return tokenizer


def model_path_of(folder: Path, manifest: Manifest) -> tuple[Path, GraphFacts]:
    """The graph's real path and facts, once it and every external data file it names are
    known to lie inside ``folder`` (onnxruntime before 1.24 follows ``../`` in external data
    locations)."""
    path = _regular_file(folder, manifest.model_file, "model_file")
    base = path.parent.relative_to(folder.resolve())
    facts = read_graph_facts(path)
    for location in facts.locations:
        name = (base / location).as_posix()
        data = resolve_inside(folder, name, "external data location", where=str(path))
        if not data.is_file():
            raise ModelLoadError(
                f"{path}: its external data file {location!r} is missing or not a regular "
                "file; the model folder is incomplete"
            )
    return path, facts


def _regular_file(folder: Path, name: str, key: str) -> Path:
    """The real path of a file the manifest names; it must be a regular file in ``folder``
    (not a FIFO, which would block the load forever)."""
    path = resolve_inside(folder, name, key)
    if not path.is_file():
        raise ModelLoadError(
            f"{MANIFEST_NAME}: {key}={name!r} is missing or not a regular file; the model "
            "folder is incomplete"
        )
    return path


def _check_tokenizer_size(tokenizer: JsonTokenizer, path: Path, arch: Architecture) -> None:
    """Every id the tokenizer can produce must have a row in the graph's logits."""
    size = tokenizer.size
    if size > arch.vocab_size:
        raise ModelLoadError(
            f"{MANIFEST_NAME}: architecture.vocab_size={arch.vocab_size} is smaller than the "
            f"tokenizer {path.name} ({size} ids); the manifest or tokenizer does not belong to "
            "this model — re-convert it"
        )


def _read_optional(folder: Path, name: str | None) -> str | None:
    """The chat template's text; None when the manifest names none or the file is absent."""
    if name is None:
        return None
    path = resolve_inside(folder, name, "chat_template_file")
    if not path.is_file():
        return None
    try:
        data = read_regular_file(path, max_bytes=_MAX_TEMPLATE_BYTES, error=ModelLoadError)
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(
            f"{MANIFEST_NAME}: chat_template_file={name!r} is not UTF-8 text: {exc}"
        ) from exc
    except ModelLoadError as exc:  # replaced by a FIFO or grown since the check: named
        raise ModelLoadError(f"{MANIFEST_NAME}: chat_template_file={name!r}: {exc}") from exc
