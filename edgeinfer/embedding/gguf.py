"""GGUF embedding models (BERT encoders) through llama.cpp's embedding mode.

``is_embedding_gguf`` tells an encoder GGUF from a generative one (its architecture, or a
``<arch>.pooling_type`` key); ``check_embedding_gguf`` bounds what llama.cpp will read
(architecture, pooling type, causal flag, dimensions, the embedding and position tables)
before it opens the file; ``load_gguf_embedding`` plans memory for a batch of texts of the
maximum length (the same plan as the ONNX encoder route) and opens the backend
(``runtimes/llama_embed.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import LoadConfig
from ..errors import ModelLoadError
from ..files import catalog
from ..files.encoder_folder import EncoderConfig, EncoderFolder
from ..files.gguf_file import GGUFHeader
from ..memory.budget import MemoryBudget
from ..model import Model
from .load import embedding_model, plan_embedding_memory, source_key

__all__ = [
    "GGUFEncoder",
    "check_embedding_gguf",
    "derived_encoder_gguf",
    "is_embedding_gguf",
    "load_gguf_embedding",
]

logger = logging.getLogger(__name__)

ENCODER_ARCHITECTURES = ("bert",)  # what llama.cpp's embedding mode is tested with here
POOLINGS = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum llama_pooling_type
# bounds on what a file may claim (all-MiniLM: 384 wide, 6 layers, 1536 inner, 512 positions)
_MOST = {"embedding_length": 8192, "block_count": 128, "feed_forward_length": 65536,
         "attention.head_count": 256, "context_length": 8192}  # fmt: skip


@dataclass(frozen=True)
class GGUFEncoder:
    """The facts of a checked encoder GGUF the memory plan and the backend read."""

    header: GGUFHeader
    config: EncoderConfig
    pooling: str
    pooling_code: int
    max_seq_length: int

    @property
    def weight_bytes(self) -> int:
        return self.header.weight_nbytes


def is_embedding_gguf(header: GGUFHeader) -> bool:
    """Whether the file is an embedding model (to be checked by check_embedding_gguf)."""
    return header.architecture in ENCODER_ARCHITECTURES or (
        header.arch_value("pooling_type") is not None
    )


def check_embedding_gguf(header: GGUFHeader) -> GGUFEncoder:
    """The encoder's facts; ModelLoadError naming the key when llama.cpp should not see it."""
    arch = header.architecture
    where = f"{header.path}"
    if arch not in ENCODER_ARCHITECTURES:
        raise ModelLoadError(
            f"{where}: {arch}.pooling_type marks an embedding model, but edgeinfer runs only "
            f"{', '.join(ENCODER_ARCHITECTURES)} embedding GGUFs; use its sentence-transformers "
            "folder instead (edgeinfer.load(folder))"
        )
    code = header.arch_value("pooling_type")
    if isinstance(code, bool) or code not in POOLINGS:
        raise ModelLoadError(
            f"{where}: {arch}.pooling_type={code!r} is not one of "
            f"{', '.join(f'{k} ({v})' for k, v in POOLINGS.items())}; convert the model again"
        )
    if header.arch_value("attention.causal", False) is not False:
        raise ModelLoadError(f"{where}: {arch}.attention.causal must be false for an encoder")
    sizes = {key: _bounded(header, key, most) for key, most in _MOST.items()}
    hidden, heads = sizes["embedding_length"], sizes["attention.head_count"]
    if hidden % heads:
        raise ModelLoadError(
            f"{where}: {arch}.embedding_length={hidden} is not a multiple of "
            f"{arch}.attention.head_count={heads}"
        )
    _check_tables(header, hidden, sizes["context_length"])
    config = EncoderConfig(
        model_type=arch, hidden_size=hidden, num_attention_heads=heads,
        num_hidden_layers=sizes["block_count"], intermediate_size=sizes["feed_forward_length"],
        max_position_embeddings=sizes["context_length"], type_vocab_size=2,
        vocab_size=_vocab(header, hidden),
        layer_norm_eps=float(header.arch_value("attention.layer_norm_epsilon", 1e-12)),
        hidden_act="gelu",
    )  # fmt: skip
    pooling = POOLINGS[code]
    return GGUFEncoder(header, config, pooling, code, sizes["context_length"])


def _bounded(header: GGUFHeader, key: str, most: int) -> int:
    value = header.arch_value(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ModelLoadError(
            f"{header.path}: {header.architecture}.{key}={value!r} must be an integer from 1 "
            f"to {most:,} for an embedding model; the file is damaged or not supported"
        )
    return value


def _tensor_shape(header: GGUFHeader, name: str) -> tuple[int, ...] | None:
    for tensor in header.tensors:
        if tensor.name == name:
            return tuple(tensor.shape)
    return None


def _vocab(header: GGUFHeader, hidden: int) -> int:
    shape = _tensor_shape(header, "token_embd.weight")
    if shape is None or len(shape) != 2 or shape[0] != hidden:
        raise ModelLoadError(
            f"{header.path}: token_embd.weight has shape {shape}, expected ({hidden}, vocab)"
        )
    return int(shape[1])


def _check_tables(header: GGUFHeader, hidden: int, context: int) -> None:
    shape = _tensor_shape(header, "position_embd.weight")
    if shape != (hidden, context):
        raise ModelLoadError(
            f"{header.path}: position_embd.weight has shape {shape}, expected "
            f"({hidden}, {context}) for {header.architecture}.context_length={context}"
        )


def load_gguf_embedding(
    source: Any, config: LoadConfig, budget: MemoryBudget | int | str | None
) -> Model:
    """``source`` (a ``ModelSource`` of format "gguf" holding an encoder) as an embedding
    Model on llama.cpp (CPU)."""
    encoder = check_embedding_gguf(source.header)
    plan = plan_embedding_memory(encoder, budget, config.resolved_threads)
    config = dataclasses.replace(config, batch_size=plan.batch_size)
    from ..runtimes.llama_embed import LlamaEmbedBackend

    backend = LlamaEmbedBackend(source.path, encoder, config.resolved_threads)
    why = "an embedding GGUF runs in llama.cpp's embedding mode"
    chain = [{"provider": "llama.cpp CPU", "device": "cpu", "outcome": "chosen", "reason": why}]
    return embedding_model(source, backend, plan, chain, "gguf", why)


def derived_encoder_gguf(name: str, folder: EncoderFolder, outtype: str = "f32") -> Path:
    """``folder`` (a BERT sentence-transformers folder) as a GGUF, converted once into
    ``$EDGEINFER_HOME/derived`` (keyed by the source's sha256, the converter's format and
    the sha256 of its code)."""
    from ..converters.gguf import bert

    code = hashlib.sha256(Path(bert.__file__).read_bytes()).hexdigest()[:8]
    key = f"{source_key(name, folder)}-gguf-{outtype}-v{bert.BERT_GGUF_FORMAT}-{code}"
    out = catalog.edgeinfer_home() / "derived" / key / "encoder.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("%s: converting it once to %s", name, out)
    return bert.write_bert_gguf(folder, out, outtype)
