"""What ``load()`` will run and in how much memory: the route, the source it opens (a catalog
GGUF's ONNX transcode, built once under ``$EDGEINFER_HOME/derived``) and the memory plan, by
one set of rules for this machine (``load()``) and for a recorded one (``edgeinfer devices
--inventory``):

- the route is ``routes.route_on`` over the machine's inventory;
- a draft model with a shorter trained context caps the context;
- an ONNX graph with a float16 KV cache on the CPU prefills in chunks of at most 64;
- a transcode whose plan does not fit the budget leaves the GGUF on llama.cpp when its plan
  does (unless an engine was asked for);
- ``parallel="auto"`` whose plan holds one slot takes the route of one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

from .config import LoadConfig
from .errors import BackendUnavailableError, InvalidRequestError, MemoryBudgetError, ModelLoadError
from .files import catalog
from .files.manifest import MANIFEST_NAME, PARTIAL_MARKER, Manifest
from .files.source import ModelSource
from .machine.inventory import DeviceInventory, devices
from .machine.policy import normalise_device
from .machine.routes import Route, route_on
from .memory.plan import FRESH_PROCESS_BYTES, FitAtLoad, MemoryBudget, MemoryPlan, plan_memory
from .memory.shape import ModelShape, shape_of

logger = logging.getLogger(__name__)

__all__ = [
    "HALF_KV_CPU_BATCHES",
    "Machine",
    "native_folder_for",
    "plan_load",
    "route_for",
    "routed",
    "runs_as_onnx",
    "transcoded_catalog_model",
]

# onnxruntime's CPU attention on a float16 cache works in float workspaces that grow with
# the prefill chunk: in chunks of 512 a prompt that fills the context peaked above the
# float32 cache's peak, so such graphs prefill in chunks of 64 at most (README "Memory",
# benchmarks/results/onnx_memory_long_*.json; tests/test_onnx_memory.py checks the plan).
HALF_KV_CPU_BATCHES = (64, 32)


@dataclass(frozen=True)
class Machine:
    """The machine a plan is for: this one (``inventory`` None: read when needed, the
    process's own size and RAM), or a recorded one, planned as a fresh process there."""

    inventory: DeviceInventory | None = None

    def devices(self, engines: tuple[str, ...] = ()) -> DeviceInventory:
        return devices(engines=engines) if self.inventory is None else self.inventory

    def plan(self, shape: ModelShape, **options: object) -> MemoryPlan:
        """``memory.plan_memory`` on this machine: a recorded one's available RAM, a fresh
        process there, and its physical cores for threads (what ``load()`` computes on)."""
        inventory = self.inventory
        if inventory is not None:
            options.update(
                available=inventory.available_ram,
                process=FRESH_PROCESS_BYTES,
                engine_loaded=False,
                threads=max(1, inventory.physical_cores or 1),
            )
        return plan_memory(shape, **options)  # type: ignore[arg-type]


HERE = Machine()


def route_for(
    model: str | PathLike[str],
    source: ModelSource,
    device: str,
    *,
    parallel: int = 1,
    engine: str = "auto",
    machine: Machine = HERE,
) -> Route:
    """The route ``load()`` takes for ``source``: ``routes.route_on`` over the machine's
    inventory (llama.cpp is asked for its devices only where there is a GPU)."""
    normalise_device(device)  # an unknown device is refused before the machine is read
    transcodable = catalog_gguf(model, source)
    gpu = transcodable and bool(machine.devices().gpus)
    inventory = machine.devices(engines=("llama_cpp",) if gpu else ())
    reads = 1.0
    if transcodable:  # the builder's package, only for a catalog GGUF
        from .converters.onnx.builder.gguf_blocks import transcode_reads

        reads = transcode_reads(source.header.tensors)
    return route_on(inventory, source.format, transcodable=transcodable, parallel=parallel,
                    device=device, engine=engine, transcode_reads=reads)  # fmt: skip


def runs_as_onnx(
    model: str | PathLike[str],
    source: ModelSource,
    device: str,
    *,
    parallel: int = 1,
    engine: str = "auto",
) -> bool:
    """Whether ``load()`` runs this GGUF through its ONNX transcode (see ``machine/routes.py``)."""
    route = route_for(model, source, device, parallel=parallel, engine=engine)
    return route.format == "onnx" and source.format == "gguf"


def routed(
    model: str | PathLike[str],
    named: ModelSource,
    config: LoadConfig,
    budget: MemoryBudget,
    parallel: int | str,
    engine: str,
    draft: ModelSource | None = None,
    machine: Machine = HERE,
) -> tuple[ModelSource, Route, LoadConfig]:
    """The source to open (the named one or its ONNX transcode), the route that chose it,
    and ``config`` fitted to the memory plan for its slots (and ``draft``, a draft model's
    source): ``config.fit_context.plan`` is the plan."""
    wanted = 2 if parallel == "auto" else int(parallel)
    route = route_for(model, named, config.device, parallel=wanted, engine=engine, machine=machine)
    source = source_for(named, route, config.kv_dtype)
    shape = shape_of(draft) if draft is not None else None
    fit = (config, budget, machine)
    try:
        fitted = _fitted(source, *fit, parallel, shape)
    except MemoryBudgetError as exc:
        if source is named or engine != "auto":  # no other route, or this one was asked for
            raise
        fitted = _fitted(named, *fit, parallel, shape)  # raises if it fails too
        return named, _budget_route(named, exc), fitted
    if fitted.parallel == 1 and wanted > 1:
        single = route_for(model, named, config.device, engine=engine, machine=machine)
        if single.format != route.format:
            route, source = single, named
            fitted = _fitted(source, *fit, 1, shape)
    return source, route, fitted


def plan_load(
    model: str | PathLike[str],
    named: ModelSource,
    config: LoadConfig,
    budget: MemoryBudget,
    machine: Machine = HERE,
) -> tuple[Route, MemoryPlan]:
    """The route and memory plan ``load(model, ...)`` makes on ``machine`` (one slot)."""
    _, route, fitted = routed(model, named, config, budget, 1, "auto", machine=machine)
    assert fitted.fit_context is not None
    return route, fitted.fit_context.plan


def _fitted(
    source: ModelSource,
    config: LoadConfig,
    budget: MemoryBudget,
    machine: Machine,
    parallel: int | str,
    draft: ModelShape | None = None,
) -> LoadConfig:
    """``config`` with the slots, context and batch the memory plan for ``source`` (and a
    draft model's ``draft``, whose cache holds the same context) allows."""
    shape = shape_of(source, config.kv_dtype)
    if draft is not None and 0 < draft.trained_context < shape.trained_context:
        if (config.context_length or 0) > draft.trained_context:
            raise InvalidRequestError(
                f"context_length={config.context_length} exceeds the draft model's trained "
                f"context ({draft.trained_context} tokens); use at most that"
            )
        shape = dataclasses.replace(shape, trained_context=draft.trained_context)
    half_kv_cpu = _half_kv_on_cpu(source, shape, config, machine)
    memory = machine.plan(
        shape,
        budget=budget,
        context_length=config.context_length,
        threads=config.resolved_threads,
        parallel=parallel,
        draft=draft,
        **({"batches": HALF_KV_CPU_BATCHES} if half_kv_cpu else {}),
    )
    # the backend re-fits the context to the resident set once it holds the weights
    fit = FitAtLoad(shape, memory, fixed_context=config.context_length is not None, draft=draft)
    return dataclasses.replace(
        config,
        context_length=memory.context_length,
        batch_size=memory.batch_size,
        parallel=memory.parallel,
        fit_context=fit,
    )


def _half_kv_on_cpu(
    source: ModelSource, shape: ModelShape, config: LoadConfig, machine: Machine
) -> bool:
    """An ONNX graph with a float16 KV cache that will run on the CPU."""
    if source.format != "onnx" or shape.kv_element_bytes != 2:
        return False
    wish = normalise_device(config.device)
    return wish == "cpu" or (wish == "auto" and not machine.devices().gpus)


def _budget_route(named: ModelSource, refused: MemoryBudgetError) -> Route:
    """The GGUF kept on llama.cpp because its transcode's plan did not fit the budget."""
    first = str(refused).split(";")[0]
    why = (
        f"the ONNX transcode's memory plan does not fit the budget ({first}); llama.cpp's plan "
        "for the GGUF itself does, so it runs on llama.cpp"
    )
    logger.info("%s route: %s", named.name, why)
    return Route(named.format, named.format, why)


def source_for(named: ModelSource, route: Route, kv_dtype: str) -> ModelSource:
    """What ``route`` opens: ``named``, or its ONNX transcode with a ``kv_dtype`` cache; an
    ONNX folder only with the cache type its graph takes."""
    if route.format != named.format:
        return transcoded_catalog_model(named, "float16" if kv_dtype == "float16" else "float32")
    if named.format == "onnx" and kv_dtype != "auto":
        built = named.header.architecture.kv_dtype
        if built != kv_dtype:
            raise InvalidRequestError(
                f"kv_dtype={kv_dtype!r}: {named.name}'s graph takes a {built} KV cache; build "
                f"one for {kv_dtype} with 'edgeinfer convert SOURCE --to onnx --kv-dtype "
                f"{kv_dtype}', or load it with kv_dtype='auto'"
            )
    return named


def catalog_gguf(model: str | PathLike[str], source: ModelSource) -> bool:
    """Whether ``model`` names a catalog GGUF (not a file of the same name)."""
    text = str(model)
    return (
        source.format == "gguf"
        and catalog.lookup(text) is not None
        and not Path(text).expanduser().exists()
    )


def transcoded_catalog_model(source: ModelSource, kv_dtype: str = "float32") -> ModelSource:
    """The catalog GGUF ``source`` as an ONNX folder of the native builder (its blocks kept
    exactly, its KV cache of ``kv_dtype``), made once under ``$EDGEINFER_HOME/derived`` and
    reused."""
    folder = native_folder_for(source, kv_dtype)
    if not (folder / MANIFEST_NAME).is_file() or (folder / PARTIAL_MARKER).exists():
        logger.warning(
            "%s: building its ONNX graph once into %s (native builder, blocks kept)",
            source.name,
            folder,
        )
        try:
            _build_native(source.path, folder, kv_dtype)
        except OSError as exc:  # a home that cannot be written, a full disk
            raise ModelLoadError(
                f"{source.name}: cannot build its ONNX graph in {folder}: {exc}; free some "
                "space, set EDGEINFER_HOME to a writable folder, or load it with "
                "engine='llama.cpp'"
            ) from exc
    return ModelSource(source.name, folder, "onnx", Manifest.read(folder))


def native_folder_for(source: ModelSource, kv_dtype: str = "float32") -> Path:
    """Where the catalog model ``source`` is transcoded: keyed by its checked sha256 (and a
    suffix for a float16 KV cache)."""
    entry = catalog.lookup(source.name)
    if entry is None or entry.sha256 is None:
        raise ModelLoadError(f"{source.name} is not a catalog model with a known checksum")
    name = f"{entry.sha256[:16]}-native-v{_NATIVE_FORMAT}"
    if kv_dtype == "float16":
        name += "-kv16"
    return catalog.edgeinfer_home() / "derived" / name


_NATIVE_FORMAT = 6  # bump when the builder's output changes, so old folders are rebuilt


def _build_native(src: Path, folder: Path, kv_dtype: str = "float32") -> None:
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
        write_gguf_folder(src, partial, kv_dtype=kv_dtype)
