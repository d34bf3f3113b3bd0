"""``load()``: resolve what the user named to a model file (``files/source.py``), choose its
route (``machine/routes.py``), plan its memory for its sequence slots, pick its backend, open it.

A catalog GGUF that runs on ONNX Runtime is transcoded once into an ONNX folder by the native
builder (``converters/onnx/folder.py``, which never imports this module back). The backend
for a format is found in ``edgeinfer.runtimes`` and its engine imported only then.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from os import PathLike
from typing import TYPE_CHECKING, Any

from .config import LoadConfig, check_parallel
from .embedding.gguf import is_embedding_gguf, load_gguf_embedding
from .embedding.load import load_encoder, refuse_generation_options
from .errors import (
    EdgeInferError,
    InvalidRequestError,
    MemoryBudgetError,
)
from .files.source import ModelSource, resolve
from .generation.draft_model import DraftModel
from .generation.draft_vocab import check_files, check_tokenizers
from .generation.speculative import SpeculativeConfig, parse_speculative
from .generation.state.prompt_cache import PromptCache
from .load_plan import (
    native_folder_for,
    route_for,
    routed,
    runs_as_onnx,
    source_for,
    transcoded_catalog_model,
)
from .machine.inventory import devices
from .machine.policy import plan_providers
from .machine.routes import Route, check_engine
from .memory.budget import MemoryBudget, mb
from .memory.rss import peak_rss
from .model import Model
from .runtimes import open_backend

if TYPE_CHECKING:
    from .runtimes.base import Backend

__all__ = [
    "ModelSource",
    "load",
    "native_folder_for",
    "resolve",
    "route_for",
    "runs_as_onnx",
    "transcoded_catalog_model",
]

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

    ``engine`` picks what runs a GGUF: "auto" (the rule in ``machine/routes.py``: a catalog GGUF
    on a CPU runs its exact ONNX transcode), "llama.cpp" (the file) or "onnxruntime" (the
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
    ``prompt_cache``: a folder (or True) keeping long prompts' KV on disk. ``kv_dtype``: the
    KV cache's type ("auto": the model's own; "float16" halves the ONNX route's). ``speculative``:
    requests' default ("draft:NAME" also opens a draft model: docs/speculative.md).
    """
    cache, spec, asked = _check_options(context_overflow, allow_fallback, engine, prompt_cache,
                                        speculative)  # fmt: skip
    parallel = parallel if parallel == "auto" else check_parallel(parallel)
    budget = MemoryBudget.of(memory_budget)  # refused here if invalid, before anything loads
    config = LoadConfig(device=device, context_length=context_length, threads=threads,
                        flash_attention=flash_attention, kv_dtype=kv_dtype)  # fmt: skip
    named = resolve(model)
    if _is_embedding_model(named):
        asked["parallel"] = parallel
        return _load_embedding_model(named, config, budget, allow_fallback, spec, asked)
    opened = _opened(model, named, config, budget, parallel, engine, allow_fallback, spec)
    return _model(*opened, context_overflow, cache)


def _opened(
    model: str | PathLike[str],
    named: ModelSource,
    config: LoadConfig,
    budget: MemoryBudget,
    parallel: int | str,
    engine: str,
    allow_fallback: bool,
    spec: SpeculativeConfig,
) -> tuple[Backend, ModelSource, list[dict[str, Any]], LoadConfig, Route, SpeculativeConfig]:
    """The generative model ``named`` opened on its route, in its memory plan, with the draft
    model ``spec`` names, if any: backend, source, provider chain, config, route, setting."""
    draft = _draft_source(spec, named, config.device, engine)
    source, route, config = routed(
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
    return source_for(named, route, "auto"), checked


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
    memory_budget: MemoryBudget,
    allow_fallback: bool,
    spec: SpeculativeConfig,
    asked: dict[str, Any],
) -> Model:
    """An encoder folder (embedding/load.py) or an encoder GGUF in llama.cpp's embedding mode:
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


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None
