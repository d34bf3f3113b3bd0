"""Opening an embedding model: a sentence-transformers folder (``encoder_folder.py``) built
once into an encoder graph under ``$EDGEINFER_HOME/derived`` (keyed by the sha256 of what it
was built from, written atomically, validated against a numpy forward pass of the weights),
its memory planned for a batch of texts of the maximum length, and opened on ONNX Runtime.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ..config import LoadConfig
from ..errors import BackendUnavailableError, InvalidRequestError, MemoryBudgetError
from ..files import catalog
from ..files.encoder_folder import EncoderFolder
from ..machine.inventory import devices
from ..machine.policy import plan_providers
from ..memory.budget import MemoryBudget, MemoryPlan, mb
from ..model import Model
from ..runtimes import open_backend

__all__ = [
    "EMBEDDING_OPTIONS",
    "EncoderModel",
    "encoder_graph_for",
    "load_encoder",
    "plan_embedding_memory",
    "refuse_generation_options",
    "source_key",
]

logger = logging.getLogger(__name__)

_ENCODER_FORMAT = 1  # bump when the encoder builder's output changes: old graphs are rebuilt
DEFAULT_BATCH = 32
_ENGINE_BYTES = 60 << 20  # onnxruntime's libraries, the session and the tokenizer
_HEADROOM = 64 << 20
_CHUNK = 1 << 20

EMBEDDING_OPTIONS = "device, memory_budget, threads and allow_fallback"  # what it does take
# load()'s options for generation: the value that means "not asked for", why an embedding
# model has no use for it, and its CLI flag
_GENERATION_OPTIONS: dict[str, tuple[Any, str, str]] = {
    "parallel": (1, "embeds a batch of texts per pass, with no sequence slots (embed(..., "
                 "batch_size=N) sets the batch)", "--parallel"),
    "prompt_cache": (None, "keeps no KV cache to put on disk", "--prompt-cache"),
    "kv_dtype": ("auto", "has no KV cache", "--kv-dtype"),
    "context_length": (None, "cuts each text at its own maximum sequence length "
                       "(embed_detailed says which were cut)", "--context-length"),
    "context_overflow": ("stop", "generates nothing to slide", "--context-overflow"),
    "flash_attention": (False, "runs no flash-attention kernel on either route",
                        "--flash-attention"),
}  # fmt: skip
_ENCODER_ENGINES = {"encoder": "onnxruntime", "gguf": "llama.cpp"}


def _unset(value: Any, default: Any) -> bool:
    """Whether ``value`` is the option's "not asked for" (None/False for a folder or flag)."""
    if default is None or default is False:
        return value is None or value is False
    return type(value) is type(default) and value == default


def refuse_generation_options(name: str, model_format: str, **options: Any) -> None:
    """InvalidRequestError for the first of ``options`` (load()'s keywords) set to something
    an embedding model ignores; ``engine`` may name the engine that runs ``model_format``.
    The same refusals for an encoder folder (ONNX) and an encoder GGUF (llama.cpp)."""
    for key, value in options.items():
        if key == "engine":
            ours = _ENCODER_ENGINES.get(model_format, "auto")
            if not (isinstance(value, str) and value in ("auto", ours)):
                raise InvalidRequestError(
                    f"engine={value!r:.80}: {name} is an embedding model, run by {ours} only; "
                    f"leave engine at 'auto' (no --engine). It takes {EMBEDDING_OPTIONS}"
                )
            continue
        default, why, flag = _GENERATION_OPTIONS[key]
        if not _unset(value, default):
            raise InvalidRequestError(
                f"{key}={value!r:.80}: {name} is an embedding model and {why}; leave {key} at "
                f"{default!r} (no {flag}). An embedding model takes {EMBEDDING_OPTIONS}"
            )


@dataclass(frozen=True)
class EncoderModel:
    """A checked encoder folder and the graph built from it."""

    folder: EncoderFolder
    graph: Path


def load_encoder(
    source: Any, config: LoadConfig, budget: MemoryBudget | int | str | None, allow_fallback: bool
) -> Model:
    """``source`` (a ``ModelSource`` of format "encoder") opened as an embedding Model."""
    folder: EncoderFolder = source.header
    graph = encoder_graph_for(source.name, folder)
    plan = plan_embedding_memory(folder, budget, config.resolved_threads)
    config = dataclasses.replace(config, batch_size=plan.batch_size)
    providers = plan_providers(
        devices(engines=("onnxruntime",)), "onnx", config.device, allow_fallback=allow_fallback
    )
    encoder = dataclasses.replace(source, path=source.path, header=EncoderModel(folder, graph))
    backend, chain = open_backend(encoder, config, providers)
    why = "an embedding model runs its encoder graph"
    return embedding_model(source, backend, plan, chain, "encoder", why)


def embedding_model(
    source: Any, backend: Any, plan: Any, chain: list[dict[str, Any]], model_format: str, why: str
) -> Model:
    """The Model of an opened embedding backend (either route), its memory plan logged."""
    logger.info("%s memory plan: %s", source.name, plan.describe())
    return Model(
        backend,
        name=source.name,
        path=source.path,
        model_format=model_format,
        provider_chain=chain,
        memory_plan=plan,
        route={"format": model_format, "why": why},
    )


def encoder_graph_for(name: str, folder: EncoderFolder) -> Path:
    """The encoder graph of ``folder``, built once into ``$EDGEINFER_HOME/derived``."""
    out = (
        catalog.edgeinfer_home()
        / "derived"
        / f"{source_key(name, folder)}-encoder-v{_ENCODER_FORMAT}"
    )
    from ..files.manifest import PARTIAL_MARKER

    graph = out / "encoder.onnx"
    if graph.is_file() and (out / "encoder.json").is_file() and not (out / PARTIAL_MARKER).exists():
        return graph
    for module in ("onnx", "onnxruntime"):
        if importlib.util.find_spec(module) is None:
            raise BackendUnavailableError(
                f"embedding models build their graph once with {module}: "
                "pip install 'edgeinfer[onnx]'"
            )
    from ..converters.atomic import atomic_output_dir
    from ..converters.onnx.encoder import build_encoder, validate_encoder, write_manifest

    logger.warning("%s: building its encoder graph once into %s", name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_dir(out, overwrite=True) as partial:
        built = build_encoder(folder, partial)
        diff = validate_encoder(folder, built)
        write_manifest(partial, folder, diff)
    logger.info("%s: encoder graph validated (largest relative difference %.1e)", name, diff)
    return graph


def source_key(name: str, folder: EncoderFolder) -> str:
    """The catalog's checksum for a catalog model; else the sha256 of the weights and config."""
    entry = catalog.lookup(name)
    if entry is not None and entry.sha256 is not None and folder.path == catalog.local_path(entry):
        return entry.sha256[:16]
    digest = hashlib.sha256()
    for path in (folder.path / "config.json", folder.weights):
        with path.open("rb") as fh:
            while block := fh.read(_CHUNK):
                digest.update(block)
    digest.update(str(folder.max_seq_length).encode())
    return digest.hexdigest()[:16]


def activation_bytes(folder: EncoderFolder) -> int:
    """Activations of one text of the maximum length, bytes: the layer's live tensors (QKV,
    context, the MLP's inner rows) and the attention scores (heads x S x S), float32."""
    cfg, seq = folder.config, folder.max_seq_length
    per_token = 6 * cfg.hidden_size + cfg.intermediate_size + cfg.num_attention_heads * seq
    return 4 * seq * per_token


def plan_embedding_memory(
    folder: EncoderFolder,
    budget: MemoryBudget | int | str | None,
    threads: int,
    *,
    process: int | None = None,
) -> MemoryPlan:
    """The memory plan of an embedding model: weights, engine, and the activations of a batch
    of texts of the maximum length (``DEFAULT_BATCH``, fewer if the budget holds fewer);
    MemoryBudgetError when not even one text fits."""
    process = psutil.Process().memory_info().rss if process is None else process
    limit, source = MemoryBudget.of(budget).resolve(process)
    fixed = process + folder.weight_bytes + _ENGINE_BYTES + _HEADROOM
    per_text = activation_bytes(folder)
    batch = min(DEFAULT_BATCH, max(0, (limit - fixed) // per_text))
    if batch < 1:
        raise MemoryBudgetError(
            f"the embedding model needs {mb(fixed + per_text)}: process {mb(process)}, weights "
            f"{mb(folder.weight_bytes)}, engine {mb(_ENGINE_BYTES)}, activations of one "
            f"{folder.max_seq_length}-token text {mb(per_text)}, headroom {mb(_HEADROOM)}; "
            f"the budget is {mb(limit)} ({source}): raise memory_budget"
        )
    return MemoryPlan(
        budget=limit,
        budget_source=source,
        process=process,
        weights=folder.weight_bytes,
        engine=_ENGINE_BYTES,
        kv_bytes_per_token=0,
        kv_factor=1.0,
        context_length=folder.max_seq_length,
        trained_context=folder.config.max_position_embeddings,
        batch_size=int(batch),
        compute=int(batch) * per_text,
        headroom=_HEADROOM,
        threads=threads,
    )
