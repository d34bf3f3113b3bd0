"""``load()``: resolve what the user named to a model file (``model_source.py``), plan its
memory, pick its backend, open it.

A catalog GGUF that runs on ONNX Runtime is transcoded once into an ONNX folder by the native
builder (``converters/onnx/folder.py``, which never imports this module back). The backend
for a format is found in ``edgeinfer.runtimes`` and its engine imported only then.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import catalog
from .config import LoadConfig
from .errors import BackendUnavailableError, InvalidRequestError, ModelLoadError
from .inventory import devices
from .manifest import MANIFEST_NAME, PARTIAL_MARKER, Manifest
from .memory import FitAtLoad, plan_memory
from .model import Model
from .model_shape import shape_of
from .model_source import ModelSource, resolve
from .policy import normalise_device, plan_providers
from .runtimes import open_backend

if TYPE_CHECKING:
    from .runtimes.base import Backend

__all__ = ["ModelSource", "load", "resolve"]

logger = logging.getLogger(__name__)


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
    _check_options(context_overflow, allow_fallback)
    config = LoadConfig(
        device=device,
        context_length=context_length,
        threads=threads,
        flash_attention=flash_attention,
    )
    source = resolve(model)
    if runs_as_onnx(model, source, device):
        source = transcoded_catalog_model(source)
    config = _fitted(source, config, memory_budget)
    backend, chain = _open(source, config, allow_fallback)
    memory_plan = config.fit_context.plan
    logger.info("%s memory plan: %s", source.name, memory_plan.describe())
    return Model(
        backend,
        name=source.name,
        path=source.path,
        model_format=source.format,
        provider_chain=chain,
        memory_plan=memory_plan,
        context_overflow=context_overflow,
    )


_ENGINES = {"gguf": "llama_cpp", "onnx": "onnxruntime"}  # the engine each format runs on


def _check_options(context_overflow: str, allow_fallback: bool) -> None:
    if context_overflow not in ("stop", "slide"):
        raise InvalidRequestError(
            f"context_overflow={context_overflow!r} is invalid: expected 'stop' or 'slide'"
        )
    if not isinstance(allow_fallback, bool):
        raise InvalidRequestError(
            f"allow_fallback={allow_fallback!r} is invalid: expected True or False"
        )


def _open(
    source: ModelSource, config: LoadConfig, allow_fallback: bool
) -> tuple[Backend, list[dict[str, Any]]]:
    """The backend for ``source`` on the first provider the device plan can open."""
    engine = _ENGINES[source.format]
    plan = plan_providers(
        devices(engines=(engine,)), source.format, config.device, allow_fallback=allow_fallback
    )
    return open_backend(source, config, plan)


def _fitted(source: ModelSource, config: LoadConfig, budget: int | str | None) -> LoadConfig:
    """``config`` with the context and batch the memory plan for ``source`` allows."""
    shape = shape_of(source)
    memory = plan_memory(
        shape,
        budget=budget,
        context_length=config.context_length,
        threads=config.resolved_threads,
    )
    # the backend re-fits the context to the resident set once it holds the weights
    fit = FitAtLoad(shape, memory, fixed_context=config.context_length is not None)
    return dataclasses.replace(
        config, context_length=memory.context_length, batch_size=memory.batch_size, fit_context=fit
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


_NATIVE_FORMAT = 3  # bump when the builder's output changes, so old folders are rebuilt


def _build_native(src: Path, folder: Path) -> None:
    try:
        from edgeinfer.converters.atomic import atomic_output_dir
        from edgeinfer.converters.onnx.folder import write_gguf_folder
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
