"""``load()``: resolve what the user named to a model file (``model_source.py``), choose its
route (``routes.py``), plan its memory for its sequence slots, pick its backend, open it.

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
from .draft_model import DraftModel
from .draft_vocab import check_files, check_tokenizers
from .embedding_gguf import is_embedding_gguf, load_gguf_embedding
from .embedding_load import load_encoder, refuse_generation_options
from .errors import (
    BackendUnavailableError,
    EdgeInferError,
    InvalidRequestError,
    MemoryBudgetError,
    ModelLoadError,
)
from .inventory import devices
from .manifest import MANIFEST_NAME, PARTIAL_MARKER, Manifest
from .memory import FitAtLoad, check_parallel, plan_memory
from .memory_plan import mb
from .model import Model
from .model_shape import ModelShape, shape_of
from .model_source import ModelSource, resolve
from .policy import normalise_device, plan_providers
from .routes import Route, check_engine, route_on
from .rss import peak_rss
from .runtimes import open_backend
from .speculative import SpeculativeConfig, parse_speculative
from .state.prompt_cache import PromptCache

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
    parallel: int | str = 1,
    engine: str = "auto",
    prompt_cache: Any = None,
    kv_dtype: str = "auto",
    speculative: str = "off",
) -> Model:
    """Open a model for generation.

    ``model`` is a catalog name (fetched into $EDGEINFER_HOME the first time), a ``.gguf``
    file, or a folder holding one model. ``device`` is "auto" (the best provider this machine
    has, falling back to the CPU), "cpu", "cuda", "metal", "npu", "gpu", "directml" or an ONNX
    Runtime provider name; a device the machine cannot provide raises
    ``BackendUnavailableError`` unless ``allow_fallback=True``. ``model.info["fallback_chain"]``
    says what was chosen and why.

    ``parallel``: sequences generated at once (slots sharing the weights, each with its own
    KV cache of ``context_length`` tokens; threads, ``generate_many`` and ``edgeinfer serve``
    batch up to that many per forward pass): 1 (the default) to 256, or "auto": the most
    slots, up to 8, the budget holds with 2048 tokens each (or ``context_length``).

    ``engine`` picks what runs a GGUF: "auto" (the rule in ``routes.py``: a catalog GGUF on a
    CPU runs its exact ONNX transcode), "llama.cpp" (the file) or "onnxruntime" (the
    transcode; catalog names only). ``model.info["route"]`` says which was taken and why.

    Memory is planned before anything is allocated (``model.info["memory_plan"]``):
    ``memory_budget`` (bytes or "512MB", "1.5GiB"; default: what the process uses now plus
    half of the RAM available now) bounds the process's peak resident memory.
    ``context_length=None`` takes the largest context that fits in each slot, capped by the
    model's trained context; a context, number of slots or budget that cannot fit raises
    ``MemoryBudgetError`` naming the parts (weights, KV cache per slot, activations, runtime
    overhead) and what would fit. When a reply fills the context it ends with
    ``finish_reason="length"``; ``context_overflow="slide"`` keeps the system prompt and the
    newer half of the conversation instead, and goes on. ``flash_attention=True`` trades
    bit-exact agreement with llama.cpp's defaults for speed on GGUF models.
    ``prompt_cache``: a folder (or True) keeping long prompts' KV on disk (``edgeinfer.state``).
    ``kv_dtype``: the KV cache's type ("auto": the model's own; "float16" halves the ONNX
    route's, docs/memory.md). ``speculative``: requests' default (``edgeinfer.speculative``;
    "draft:NAME" also opens a draft model: docs/speculative.md).
    """
    cache, spec, asked = _check_options(context_overflow, allow_fallback, engine, prompt_cache,
                                        speculative)  # fmt: skip
    parallel = parallel if parallel == "auto" else check_parallel(parallel)
    config = LoadConfig(device=device, context_length=context_length, threads=threads,
                        flash_attention=flash_attention, kv_dtype=kv_dtype)  # fmt: skip
    named = resolve(model)
    if _is_embedding_model(named):
        asked["parallel"] = parallel
        return _load_embedding_model(named, config, memory_budget, allow_fallback, spec, asked)
    opened = _opened(model, named, config, memory_budget, parallel, engine, allow_fallback, spec)
    return _model(*opened, context_overflow, cache)


def _opened(
    model: str | PathLike[str],
    named: ModelSource,
    config: LoadConfig,
    budget: int | str | None,
    parallel: int | str,
    engine: str,
    allow_fallback: bool,
    spec: SpeculativeConfig,
) -> tuple[Backend, ModelSource, list[dict[str, Any]], LoadConfig, Route, SpeculativeConfig]:
    """The generative model ``named`` opened on its route, in its memory plan, with the draft
    model ``spec`` names, if any: backend, source, provider chain, config, route, setting."""
    draft = _draft_source(spec, named, config.device, engine)
    source, route, config = _routed(
        model, named, config, budget, parallel, engine, draft[0] if draft else None
    )
    backend, chain = _open(source, config, allow_fallback)
    if draft is not None:
        spec = _open_draft(spec, draft, (named.name, backend), config, allow_fallback)
    return backend, source, chain, config, route, spec


def _model(
    backend: Backend,
    source: ModelSource,
    chain: list[dict[str, Any]],
    config: LoadConfig,
    route: Route,
    speculative: SpeculativeConfig,
    context_overflow: str,
    cache: Any = None,
) -> Model:
    memory_plan = config.fit_context.plan
    logger.info("%s memory plan: %s", source.name, memory_plan.describe())
    # said at INFO only when the model runs through another format than the one named
    level = logging.INFO if route.format != route.source else logging.DEBUG
    logger.log(level, "%s route: %s", source.name, route.why)
    return Model(
        backend,
        name=source.name,
        path=source.path,
        model_format=source.format,
        provider_chain=chain,
        memory_plan=memory_plan,
        context_overflow=context_overflow,
        route=route.to_dict(),
        prompt_cache=cache,
        speculative=speculative,
    )


def _routed(
    model: str | PathLike[str],
    named: ModelSource,
    config: LoadConfig,
    budget: int | str | None,
    parallel: int | str,
    engine: str,
    draft: ModelSource | None = None,
) -> tuple[ModelSource, Route, LoadConfig]:
    """The source to open (the named one or its ONNX transcode), the route that chose it,
    and ``config`` fitted to the memory plan for its slots (and ``draft``, a draft model's
    source). ``parallel="auto"`` takes the route of many slots; if the plan then holds one
    slot only, the route of one."""
    wanted = 2 if parallel == "auto" else int(parallel)
    route = route_for(model, named, config.device, parallel=wanted, engine=engine)
    source = _source_for(named, route, config.kv_dtype)
    shape = shape_of(draft) if draft is not None else None
    try:
        fitted = _fitted(source, config, budget, parallel, shape)
    except MemoryBudgetError as exc:
        if source is named or engine != "auto":  # no other route, or this one was asked for
            raise
        fitted = _fitted(named, config, budget, parallel, shape)  # raises if it fails too
        return named, _budget_route(named, exc), fitted
    if fitted.parallel == 1 and wanted > 1:
        single = route_for(model, named, config.device, parallel=1, engine=engine)
        if single.format != route.format:
            route, source = single, named
            fitted = _fitted(source, config, budget, 1)
    return source, route, fitted


def _budget_route(named: ModelSource, refused: MemoryBudgetError) -> Route:
    """The GGUF kept on llama.cpp because its transcode's plan did not fit the budget."""
    first = str(refused).split(";")[0]
    why = (
        f"the ONNX transcode's memory plan does not fit the budget ({first}); llama.cpp's plan "
        "for the GGUF itself does, so it runs on llama.cpp"
    )
    logger.info("%s route: %s", named.name, why)
    return Route(named.format, named.format, why)


def _draft_source(
    spec: SpeculativeConfig, target: ModelSource, device: str, engine: str
) -> tuple[ModelSource, bool] | None:
    """For ``speculative="draft:NAME"``: the draft model's source to open (routed as the
    target is, at one slot: at any parallel only a sequence that runs alone drafts) and
    whether its vocabulary was compared with the target's here (files of one format; else
    the opened tokenizers are compared). None for other settings."""
    if spec.method != "draft" or spec.draft is None:
        return None
    setting = f"draft:{spec.draft}"
    try:
        named = resolve(spec.draft)
    except EdgeInferError as exc:
        raise type(exc)(f"speculative={setting!r:.80}: the draft model: {exc}") from exc
    if _is_embedding_model(named):
        raise InvalidRequestError(
            f"speculative={setting!r:.80}: {named.name} is an embedding model and generates no "
            "tokens; a draft model is a smaller generative model of the same vocabulary"
        )
    checked = check_files(target, named, setting)
    route = route_for(spec.draft, named, device, parallel=1, engine=engine)
    return _source_for(named, route, "auto"), checked


def _open_draft(
    spec: SpeculativeConfig,
    draft: tuple[ModelSource, bool],
    target: tuple[str, Backend],
    config: LoadConfig,
    allow_fallback: bool,
) -> SpeculativeConfig:
    """``spec`` with its draft model opened: one slot of the target's context, the same
    device and threads. The target (and the draft) are closed again if it cannot be used."""
    source, checked = draft
    name, backend = target
    plan = config.fit_context.plan  # type: ignore[union-attr]
    draft_config = LoadConfig(device=config.device, context_length=backend.n_ctx,
                              threads=config.threads, flash_attention=config.flash_attention,
                              batch_size=plan.batch_size, cpu_share=config.cpu_share)  # fmt: skip
    opened: list[Backend] = [backend]
    try:
        opened.append(_open(source, draft_config, allow_fallback)[0])
        if not checked:
            check_tokenizers(backend.tokenizer, opened[1].tokenizer, (name, source.name),
                             f"draft:{spec.draft}")  # fmt: skip
        if peak_rss() > plan.budget:
            raise MemoryBudgetError(
                f"loading {name} and its draft model {source.name} took {mb(peak_rss())} at "
                f"the peak, over the budget of {mb(plan.budget)} ({plan.budget_source}); use "
                "a bigger memory_budget, a smaller draft model, or speculative='auto'"
            )
    except BaseException:
        for opened_backend in reversed(opened):
            opened_backend.close()
        raise
    share = plan.draft_weights / plan.weights if plan.weights else 0.3
    drafter = DraftModel(opened[1], name=spec.draft or source.name, memory=plan.draft,
                         names=(source.name, str(source.path)), prior_share=share)  # fmt: skip
    return dataclasses.replace(spec, drafter=drafter)


_ENGINES = {"gguf": "llama_cpp", "onnx": "onnxruntime"}  # the engine each format runs on


def _is_embedding_model(named: ModelSource) -> bool:
    return named.format == "encoder" or (named.format == "gguf" and is_embedding_gguf(named.header))


def _load_embedding_model(
    named: ModelSource,
    config: LoadConfig,
    memory_budget: int | str | None,
    allow_fallback: bool,
    spec: SpeculativeConfig,
    asked: dict[str, Any],
) -> Model:
    """An encoder folder (embedding_load.py) or an encoder GGUF in llama.cpp's embedding mode:
    the options only generation uses (``asked``; the config's KV cache type, context length
    and flash attention) are refused when set, never ignored."""
    if spec.on:
        raise InvalidRequestError(
            f"speculative={spec.method!r}: {named.name} is an embedding model and generates no "
            "tokens; leave speculative at 'off'"
        )
    refuse_generation_options(
        named.name, named.format, kv_dtype=config.kv_dtype, context_length=config.context_length,
        flash_attention=config.flash_attention, **asked,
    )  # fmt: skip
    if named.format == "encoder":
        return load_encoder(named, config, memory_budget, allow_fallback)
    return load_gguf_embedding(named, config, memory_budget)


def _source_for(named: ModelSource, route: Route, kv_dtype: str) -> ModelSource:
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


def _check_options(
    context_overflow: str, allow_fallback: bool, engine: str, prompt_cache: Any, speculative: Any
) -> tuple[PromptCache | None, SpeculativeConfig, dict[str, Any]]:
    """Refuse bad options before anything is loaded; the prompt cache and the speculative
    decoding they name, and those of them an embedding model must leave unset."""
    spec = parse_speculative(speculative)
    check_engine(engine)
    if context_overflow not in ("stop", "slide"):
        raise InvalidRequestError(
            f"context_overflow={context_overflow!r} is invalid: expected 'stop' or 'slide'"
        )
    if not isinstance(allow_fallback, bool):
        raise InvalidRequestError(
            f"allow_fallback={allow_fallback!r} is invalid: expected True or False"
        )
    asked = {"prompt_cache": prompt_cache, "engine": engine, "context_overflow": context_overflow}
    return PromptCache.of(prompt_cache), spec, asked


def _open(
    source: ModelSource, config: LoadConfig, allow_fallback: bool
) -> tuple[Backend, list[dict[str, Any]]]:
    """The backend for ``source`` on the first provider the device plan can open."""
    engine = _ENGINES[source.format]
    plan = plan_providers(
        devices(engines=(engine,)), source.format, config.device, allow_fallback=allow_fallback
    )
    return open_backend(source, config, plan)


def _fitted(
    source: ModelSource,
    config: LoadConfig,
    budget: int | str | None,
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
    memory = plan_memory(
        shape,
        budget=budget,
        context_length=config.context_length,
        threads=config.resolved_threads,
        parallel=parallel,
        draft=draft,
        **({"batches": HALF_KV_CPU_BATCHES} if _half_kv_on_cpu(source, shape, config) else {}),
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


# onnxruntime's CPU attention on a float16 cache works in float workspaces that grow with
# the prefill chunk: in chunks of 512 a prompt that fills the context peaked above the
# float32 cache's peak, so such graphs prefill in chunks of 64 at most (README "Memory",
# benchmarks/results/onnx_memory_long_*.json; tests/test_onnx_memory.py checks the plan).
HALF_KV_CPU_BATCHES = (64, 32)


def _half_kv_on_cpu(source: ModelSource, shape: Any, config: LoadConfig) -> bool:
    """An ONNX graph with a float16 KV cache that will run on the CPU."""
    if source.format != "onnx" or shape.kv_element_bytes != 2:
        return False
    wish = normalise_device(config.device)
    return wish == "cpu" or (wish == "auto" and not devices(engines=()).gpus)


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def route_for(
    model: str | PathLike[str],
    source: ModelSource,
    device: str,
    *,
    parallel: int = 1,
    engine: str = "auto",
) -> Route:
    """The route ``load()`` takes for ``source``: ``routes.route_on`` over this machine's
    inventory (llama.cpp is asked for its devices only where there is a GPU)."""
    normalise_device(device)  # an unknown device is refused before the machine is read
    transcodable = _catalog_gguf(model, source)
    gpu = transcodable and bool(devices(engines=()).gpus)
    inventory = devices(engines=("llama_cpp",) if gpu else ())
    return route_on(inventory, source.format, transcodable=transcodable, parallel=parallel,
                    device=device, engine=engine)  # fmt: skip


def runs_as_onnx(
    model: str | PathLike[str],
    source: ModelSource,
    device: str,
    *,
    parallel: int = 1,
    engine: str = "auto",
) -> bool:
    """Whether ``load()`` runs this GGUF through its ONNX transcode (see ``routes.py``)."""
    route = route_for(model, source, device, parallel=parallel, engine=engine)
    return route.format == "onnx" and source.format == "gguf"


def _catalog_gguf(model: str | PathLike[str], source: ModelSource) -> bool:
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
        _build_native(source.path, folder, kv_dtype)
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


_NATIVE_FORMAT = 5  # bump when the builder's output changes, so old folders are rebuilt


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
