"""A BERT encoder's forward pass in plain numpy, from the safetensors weights: the reference the
built ONNX graph is validated against (at conversion, and in the tests). Slow and exact
(float64 accumulation); for a few short probe sequences only."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from edgeinfer.files.encoder_folder import EncoderConfig

__all__ = ["gelu", "reference_hidden", "weight_getter"]


def weight_getter(weights: Mapping[str, np.ndarray]) -> Callable[[str], np.ndarray]:
    """``get(name)``: the tensor ``name`` as float32, with or without the ``bert.`` prefix
    that folders saved from a task model carry."""
    prefix = "bert." if "bert.embeddings.word_embeddings.weight" in weights else ""

    def get(name: str) -> np.ndarray:
        key = prefix + name
        if key not in weights:
            from edgeinfer.errors import ConversionError

            raise ConversionError(f"the weights have no tensor {key!r}; not a BERT encoder")
        return np.asarray(weights[key], dtype=np.float32)

    return get


def gelu(x: np.ndarray, act: str = "gelu") -> np.ndarray:
    """GELU: the exact (erf) form, or the tanh approximation for ``gelu_new``."""
    if act != "gelu":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def _erf(x: np.ndarray) -> np.ndarray:
    """erf elementwise through the standard library (numpy has none; the probes are small)."""
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def reference_hidden(
    weights: Mapping[str, np.ndarray], cfg: EncoderConfig, ids: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """The last hidden state [B, S, H] for token ids [B, S] and attention mask [B, S]."""
    w = weight_getter(weights)
    seq = ids.shape[1]
    x = w("embeddings.word_embeddings.weight")[ids].astype(np.float64)
    x = x + w("embeddings.position_embeddings.weight")[:seq]
    x = x + w("embeddings.token_type_embeddings.weight")[0]
    x = _layer_norm(
        x, w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"), cfg.layer_norm_eps
    )
    bias = np.where(mask[:, None, None, :] > 0, 0.0, -1e30)  # [B, 1, 1, S]
    for i in range(cfg.num_hidden_layers):
        x = _layer(w, cfg, f"encoder.layer.{i}.", x, bias)
    return x.astype(np.float32)


def _layer(
    w: Callable[[str], np.ndarray], cfg: EncoderConfig, p: str, x: np.ndarray, bias: np.ndarray
) -> np.ndarray:
    def dense(name: str, h: np.ndarray) -> np.ndarray:
        return h @ w(f"{p}{name}.weight").T.astype(np.float64) + w(f"{p}{name}.bias")

    b, s, _ = x.shape
    heads, d = cfg.num_attention_heads, cfg.head_dim

    def split(h: np.ndarray) -> np.ndarray:  # [B, S, H] -> [B, heads, S, d]
        return h.reshape(b, s, heads, d).transpose(0, 2, 1, 3)

    q = split(dense("attention.self.query", x))
    k = split(dense("attention.self.key", x))
    v = split(dense("attention.self.value", x))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + bias
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, heads * d)
    eps = cfg.layer_norm_eps
    x = _layer_norm(
        x + dense("attention.output.dense", ctx),
        w(f"{p}attention.output.LayerNorm.weight"),
        w(f"{p}attention.output.LayerNorm.bias"),
        eps,
    )
    inner = gelu(dense("intermediate.dense", x), cfg.hidden_act)
    return _layer_norm(
        x + dense("output.dense", inner),
        w(f"{p}output.LayerNorm.weight"),
        w(f"{p}output.LayerNorm.bias"),
        eps,
    )
