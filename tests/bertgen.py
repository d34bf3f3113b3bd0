"""A tiny random BERT sentence-transformers folder, written with numpy and the tokenizers
library: config.json, model.safetensors, tokenizer.json (WordPiece), modules.json and the
pooling configuration. For the embedding tests; no download."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_POOLING_KEYS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "last": "pooling_mode_lasttoken",
    "max": "pooling_mode_max_tokens",
}


def vocabulary() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = ["hello", "world", "the", "cat", "sat", "on", "mat", "é", "日", "本"]
    pieces = [*_LETTERS, *(f"##{c}" for c in _LETTERS), *"0123456789.,!?'"]
    return specials + words + pieces


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {}
    offset = 0
    for name, array in tensors.items():
        kind = {np.float32: "F32", np.int64: "I64"}[array.dtype.type]
        header[name] = {
            "dtype": kind,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for array in tensors.values():
            fh.write(np.ascontiguousarray(array).tobytes())


def bert_weights(
    vocab: int, hidden: int, layers: int, inner: int, positions: int, seed: int, prefix: str = ""
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def r(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {
        "embeddings.word_embeddings.weight": r(vocab, hidden, scale=1.0),
        "embeddings.position_embeddings.weight": r(positions, hidden),
        "embeddings.token_type_embeddings.weight": r(2, hidden),
        "embeddings.LayerNorm.weight": 1 + r(hidden, scale=0.1),
        "embeddings.LayerNorm.bias": r(hidden, scale=0.1),
        "embeddings.position_ids": np.arange(positions, dtype=np.int64)[None],
    }
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for part in ("query", "key", "value"):
            w[f"{p}attention.self.{part}.weight"] = r(hidden, hidden)
            w[f"{p}attention.self.{part}.bias"] = r(hidden, scale=0.1)
        w[f"{p}attention.output.dense.weight"] = r(hidden, hidden)
        w[f"{p}attention.output.dense.bias"] = r(hidden, scale=0.1)
        w[f"{p}intermediate.dense.weight"] = r(inner, hidden)
        w[f"{p}intermediate.dense.bias"] = r(inner, scale=0.1)
        w[f"{p}output.dense.weight"] = r(hidden, inner)
        w[f"{p}output.dense.bias"] = r(hidden, scale=0.1)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[f"{p}{ln}.weight"] = 1 + r(hidden, scale=0.1)
            w[f"{p}{ln}.bias"] = r(hidden, scale=0.1)
    return {prefix + k: v for k, v in w.items()}


def write_tokenizer(path: Path, vocab: list[str]) -> None:
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    tok = Tokenizer(WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", vocab.index("[CLS]")), ("[SEP]", vocab.index("[SEP]"))],
    )
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.save(str(path))


def make_bert_folder(
    folder: Path,
    *,
    pooling: str = "mean",
    max_seq_length: int = 24,
    hidden: int = 32,
    heads: int = 4,
    layers: int = 2,
    seed: int = 0,
    normalize: bool = True,
    prefix: str = "",
) -> Path:
    """A random BERT sentence-transformers folder at ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    positions = 64
    config = {
        "model_type": "bert",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "intermediate_size": 4 * hidden,
        "max_position_embeddings": positions,
        "type_vocab_size": 2,
        "vocab_size": len(vocab),
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
    }
    (folder / "config.json").write_text(json.dumps(config))
    weights = bert_weights(len(vocab), hidden, layers, 4 * hidden, positions, seed, prefix)
    write_safetensors(folder / "model.safetensors", weights)
    write_tokenizer(folder / "tokenizer.json", vocab)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pool = {key: False for key in _POOLING_KEYS.values()}
    pool[_POOLING_KEYS[pooling]] = True
    pool["word_embedding_dimension"] = hidden
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    return folder
