"""A BERT-family encoder folder (safetensors) as an ONNX graph of onnxruntime's fused
transformer ops, built natively (no torch), then validated against a numpy forward pass of
the same weights (``encoder_reference.py``).

Graph: ``input_ids`` int32 [B, S], ``attention_mask`` int32 [B, S] (right padding) ->
``last_hidden_state`` float32 [B, S, H]. One EmbedLayerNormalization (words + positions +
token type 0, folded into the word table, then LayerNorm; it also turns the mask into each
sequence's length), then per layer: Attention (packed QKV, fused softmax over the valid keys),
MatMul + SkipLayerNormalization (output bias, residual, LayerNorm in one op), MatMul +
BiasGelu, MatMul + SkipLayerNormalization. Pooling happens outside the graph, as the
folder's configuration says.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.files.encoder_folder import EncoderFolder, read_safetensors

from .builder.graph import Graph
from .encoder_reference import reference_hidden, weight_getter

__all__ = ["ENCODER_GRAPH", "build_encoder", "validate_encoder"]

logger = logging.getLogger(__name__)

ENCODER_GRAPH = "encoder.onnx"
_DATA_FILE = "encoder.onnx.data"
_MS = "com.microsoft"
# validation: the largest difference allowed between the graph's hidden states and the
# numpy reference's, relative to the reference's largest magnitude
_TOLERANCE = 2e-4


def build_encoder(folder: EncoderFolder, out: Path) -> Path:
    """Write ``encoder.onnx`` (+ its data file) for ``folder`` into ``out``; return the graph."""
    weights = read_safetensors(folder.weights)
    w = weight_getter(weights)
    cfg = folder.config
    with (out / _DATA_FILE).open("wb") as data:
        g = Graph(data, _DATA_FILE)
        hidden, lengths = _embeddings(g, w, folder)
        for i in range(cfg.num_hidden_layers):
            hidden = _layer(g, w, folder, f"encoder.layer.{i}.", hidden, lengths)
        g.node_named("Identity", [hidden], ["last_hidden_state"])
    path = out / ENCODER_GRAPH
    _save(g, path, cfg.hidden_size)
    return path


def _embeddings(g: Graph, w: Any, folder: EncoderFolder) -> tuple[str, str]:
    """(hidden [B, S, H], lengths [B]): EmbedLayerNormalization over words and positions."""
    # token type 0 is the only one a single text uses: fold its row into the word table
    words = w("embeddings.word_embeddings.weight") + w("embeddings.token_type_embeddings.weight")[0]
    positions = w("embeddings.position_embeddings.weight")[: folder.max_seq_length]
    hidden, lengths = g.node(
        "EmbedLayerNormalization",
        [
            "input_ids",
            "",
            g.const("word_embeddings", words.astype(np.float32)),
            g.const("position_embeddings", np.ascontiguousarray(positions)),
            "",
            g.const("embeddings_ln_gamma", w("embeddings.LayerNorm.weight")),
            g.const("embeddings_ln_beta", w("embeddings.LayerNorm.bias")),
            "attention_mask",
        ],
        n_out=2,
        domain=_MS,
        epsilon=folder.config.layer_norm_eps,
    )
    return hidden, lengths


def _linear(g: Graph, w: Any, x: str, name: str) -> str:
    """x @ W^T (the bias is left to the fused op that follows)."""
    return g.node(
        "MatMul", [x, g.const(name + ".wt", np.ascontiguousarray(w(name + ".weight").T))]
    )[0]


def _layer(g: Graph, w: Any, folder: EncoderFolder, p: str, x: str, lengths: str) -> str:
    cfg = folder.config
    qkv = [f"{p}attention.self.{part}" for part in ("query", "key", "value")]
    packed = np.concatenate([w(n + ".weight").T for n in qkv], axis=1)  # [H, 3H]
    attn = g.node(
        "Attention",
        [
            x,
            g.const(p + "qkv.wt", np.ascontiguousarray(packed)),
            g.const(p + "qkv.bias", np.concatenate([w(n + ".bias") for n in qkv])),
            lengths,
        ],
        domain=_MS,
        num_heads=cfg.num_attention_heads,
    )[0]
    eps = cfg.layer_norm_eps
    x = _skip_norm(
        g, w, _linear(g, w, attn, p + "attention.output.dense"), x, p + "attention.", eps
    )
    inner = _linear(g, w, x, p + "intermediate.dense")
    act = "BiasGelu" if cfg.hidden_act == "gelu" else "FastGelu"
    inner = g.node(
        act, [inner, g.const(p + "inter.bias", w(p + "intermediate.dense.bias"))], domain=_MS
    )[0]
    return _skip_norm(g, w, _linear(g, w, inner, p + "output.dense"), x, p, eps)


def _skip_norm(g: Graph, w: Any, y: str, residual: str, p: str, eps: float) -> str:
    """LayerNorm(y + bias + residual), ``p`` the prefix of ``output.dense`` and its LayerNorm."""
    return g.node(
        "SkipLayerNormalization",
        [
            y,
            residual,
            g.const(p + "output.LayerNorm.weight", w(p + "output.LayerNorm.weight")),
            g.const(p + "output.LayerNorm.bias", w(p + "output.LayerNorm.bias")),
            g.const(p + "output.dense.bias", w(p + "output.dense.bias")),
        ],
        domain=_MS,
        epsilon=eps,
    )[0]


def _save(g: Graph, path: Path, hidden: int) -> None:
    import onnx
    from onnx import TensorProto, helper

    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", "sequence"])
        for n in ("input_ids", "attention_mask")
    ]
    output = helper.make_tensor_value_info(
        "last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden]
    )
    graph = helper.make_graph(g.nodes, "encoder", inputs, [output], g.initializers)
    model: Any = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(_MS, 1)],
        producer_name="edgeinfer",
    )
    onnx.save_model(model, str(path))


def probe_batch(folder: EncoderFolder) -> tuple[np.ndarray, np.ndarray]:
    """Two sequences of different lengths (right-padded), ids spread over the vocabulary."""
    cfg = folder.config
    n = min(12, folder.max_seq_length)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(2, n)).astype(np.int32)
    mask = np.ones((2, n), np.int32)
    mask[1, max(1, n // 2) :] = 0
    ids[mask == 0] = 0
    return ids, mask


def validate_encoder(folder: EncoderFolder, graph: Path) -> float:
    """The graph's largest relative difference from the numpy reference on the probe batch;
    ConversionError past the tolerance."""
    import onnxruntime as ort

    ids, mask = probe_batch(folder)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
    want = reference_hidden(read_safetensors(folder.weights), folder.config, ids, mask)
    valid = mask.astype(bool)
    diff = float(np.abs(got[valid] - want[valid]).max() / max(1e-6, np.abs(want[valid]).max()))
    if not diff <= _TOLERANCE:
        raise ConversionError(
            f"the encoder graph built from {folder.path} differs from its weights' reference by "
            f"{diff:.2e} (allowed {_TOLERANCE:.0e}); report this model to the maintainers"
        )
    return diff


def write_manifest(out: Path, folder: EncoderFolder, diff: float) -> None:
    facts = {"graph": ENCODER_GRAPH, "source": str(folder.path), "validation_max_rel_diff": diff}
    (out / "encoder.json").write_text(json.dumps(facts, indent=1) + "\n")
