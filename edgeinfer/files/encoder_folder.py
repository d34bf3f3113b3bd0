"""A sentence-transformers folder (a BERT-family encoder in safetensors, its tokenizer.json and
its pooling configuration) read and checked without an engine: only the standard library and
numpy. A folder comes from strangers, so every field is typed and bounded here, where it
enters; the safetensors header too, before any tensor is mapped.

    folder/config.json                model_type, sizes, layer_norm_eps, hidden_act
    folder/model.safetensors          the weights (read by ``read_safetensors``)
    folder/tokenizer.json             the tokenizer (WordPiece for BERT)
    folder/modules.json               which modules follow the transformer (pooling, normalize)
    folder/1_Pooling/config.json      pooling: mean, CLS, last token, max
    folder/sentence_bert_config.json  max_seq_length
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..bounded_json import parse_json, read_json_file
from ..errors import ModelLoadError, short_repr

__all__ = [
    "POOLINGS",
    "EncoderConfig",
    "EncoderFolder",
    "is_encoder_folder",
    "read_encoder_folder",
    "read_safetensors",
]

POOLINGS = ("mean", "cls", "last", "max")
ENCODER_TYPES = ("bert",)  # model_type values the encoder builder knows
_MAX_JSON_BYTES = 4 << 20  # a config or a pooling file is a few hundred bytes
_MAX_HEADER_BYTES = 64 << 20  # a safetensors JSON header: ~10 KB for a small encoder
_LIMITS = {
    "hidden_size": 1 << 15,
    "num_attention_heads": 1024,
    "num_hidden_layers": 1024,
    "intermediate_size": 1 << 17,
    "max_position_embeddings": 1 << 17,
    "type_vocab_size": 1 << 10,
    "vocab_size": 1 << 22,
}
_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


@dataclass(frozen=True)
class EncoderConfig:
    """What the graph builder and the memory plan need, from config.json."""

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class EncoderFolder:
    """A checked sentence-transformers folder."""

    path: Path
    config: EncoderConfig
    pooling: str  # one of POOLINGS
    normalize: bool  # the folder's own pipeline ends in Normalize
    max_seq_length: int  # tokens, special tokens included; longer texts are truncated
    weights: Path
    tokenizer: Path

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.weights.stat().st_size


def is_encoder_folder(path: Path) -> bool:
    """Whether ``path`` looks like a sentence-transformers folder (it may still fail checks)."""
    return path.is_dir() and (path / "modules.json").is_file() and (path / "config.json").is_file()


def read_encoder_folder(path: Path) -> EncoderFolder:
    """The folder at ``path`` checked: ModelLoadError naming the file and field otherwise."""
    config = _encoder_config(_json(path / "config.json"), path / "config.json")
    for name in ("model.safetensors", "tokenizer.json"):
        if not (path / name).is_file():
            raise ModelLoadError(f"{path} has no {name}; an encoder folder needs it")
    pooling, normalize = _pipeline(path)
    st = path / "sentence_bert_config.json"
    max_len = _json(st).get("max_seq_length") if st.is_file() else None
    if max_len is None:
        max_len = config.max_position_embeddings
    if not _is_int(max_len) or not 1 <= max_len:
        raise ModelLoadError(f"{st}: max_seq_length={short_repr(max_len)} is not a length")
    # the position table bounds what the model can see, whatever the folder says
    max_len = min(int(max_len), config.max_position_embeddings)
    return EncoderFolder(
        path,
        config,
        pooling,
        normalize,
        max_len,
        path / "model.safetensors",
        path / "tokenizer.json",
    )


def _json(path: Path, kind: type = dict) -> Any:
    """A JSON file of the folder, bounded (``bounded_json``), holding a ``kind``."""
    value = read_json_file(path, max_bytes=_MAX_JSON_BYTES, error=ModelLoadError)
    if not isinstance(value, kind):
        raise ModelLoadError(f"{path} must hold a JSON {'object' if kind is dict else 'list'}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encoder_config(raw: dict[str, Any], where: Path) -> EncoderConfig:
    model_type = raw.get("model_type")
    if model_type not in ENCODER_TYPES:
        raise ModelLoadError(
            f"{where}: model_type={short_repr(model_type)} is not an encoder edgeinfer can "
            f"build (supported: {', '.join(ENCODER_TYPES)})"
        )
    sizes = {key: raw.get(key, 2 if key == "type_vocab_size" else None) for key in _LIMITS}
    for key, value in sizes.items():
        if not _is_int(value) or not 1 <= value <= _LIMITS[key]:
            raise ModelLoadError(f"{where}: {key}={short_repr(value)} is not in 1..{_LIMITS[key]}")
    if sizes["hidden_size"] % sizes["num_attention_heads"]:
        raise ModelLoadError(f"{where}: hidden_size is not a multiple of num_attention_heads")
    eps = raw.get("layer_norm_eps", 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ModelLoadError(f"{where}: layer_norm_eps={short_repr(eps)} is not in (0, 1)")
    act = raw.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"{where}: hidden_act={short_repr(act)} is not supported (gelu)")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{where}: only absolute position embeddings are supported")
    return EncoderConfig(model_type, **sizes, layer_norm_eps=float(eps), hidden_act=act)


def _pipeline(path: Path) -> tuple[str, bool]:
    """The pooling and whether the folder's pipeline normalizes, from modules.json."""
    modules = _json(path / "modules.json", list)
    if not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{path / 'modules.json'} must be a list of module objects")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    pooling_dirs = [m.get("path") for m in modules if str(m.get("type", "")).endswith("Pooling")]
    if not pooling_dirs or not isinstance(pooling_dirs[0], str):
        raise ModelLoadError(f"{path}: modules.json names no Pooling module")
    pooling_dir = (path / pooling_dirs[0]).resolve()
    if not pooling_dir.is_relative_to(path.resolve()):
        raise ModelLoadError(f"{path}: the Pooling module's path leaves the folder")
    return _pooling(_json(pooling_dir / "config.json"), pooling_dir), "Normalize" in kinds


def _pooling(raw: dict[str, Any], where: Path) -> str:
    modes = {
        "cls": raw.get("pooling_mode_cls_token"),
        "mean": raw.get("pooling_mode_mean_tokens"),
        "max": raw.get("pooling_mode_max_tokens"),
        "last": raw.get("pooling_mode_lasttoken"),
        "mean_sqrt_len": raw.get("pooling_mode_mean_sqrt_len_tokens"),
        "weighted_mean": raw.get("pooling_mode_weightedmean_tokens"),
    }
    chosen = [mode for mode, on in modes.items() if on is True]
    if len(chosen) != 1 or chosen[0] not in POOLINGS:
        raise ModelLoadError(
            f"{where}: pooling {chosen or 'none'} is not supported; one of {', '.join(POOLINGS)}"
        )
    return chosen[0]


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, memory-mapped read-only (header checked first)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= min(_MAX_HEADER_BYTES, size - 8):
            raise ModelLoadError(f"{path}: header length {n} is not plausible")
        header = parse_json(fh.read(n), what=f"the header of {path}", error=ModelLoadError)
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the header is not a JSON object")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    return {k: _tensor(path, k, v, data) for k, v in header.items() if k != "__metadata__"}


def _tensor(path: Path, name: str, meta: Any, data: np.ndarray) -> np.ndarray:
    try:
        dtype = np.dtype(_DTYPES[meta["dtype"]])
        shape = [int(d) for d in meta["shape"]]
        start, end = (int(o) for o in meta["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: tensor {short_repr(name)} has a bad entry") from exc
    count = int(np.prod(shape)) if shape else 1
    if min(shape, default=0) < 0 or not 0 <= start <= end <= data.size:
        raise ModelLoadError(f"{path}: tensor {short_repr(name)} lies outside the file")
    if end - start != count * dtype.itemsize:
        raise ModelLoadError(f"{path}: tensor {short_repr(name)} has the wrong byte length")
    return data[start:end].view(dtype).reshape(shape)
