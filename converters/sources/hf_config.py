"""A Hugging Face ``config.json``, read and checked once before a conversion writes anything.

The file comes from whoever made the checkpoint: every number the converters use is checked
here for type and range (a head count of 0, a string hidden size, a negative vocabulary) and
every failure is a ConversionError naming the field. Keys the converters do not use are
dropped. Transformers 5 moves ``rope_theta`` and the scaling into ``rope_parameters``; both
spellings are read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError

__all__ = ["ModelConfig", "read_json_object", "read_model_config", "token_ids"]

_MAX_BYTES = 16 * 2**20  # a config.json is a few KB; refuse to parse absurd files
# field -> largest value accepted (far above any real model; below what overflows a plan)
_REQUIRED_INTS = {
    "num_attention_heads": 2**12,
    "num_hidden_layers": 2**12,
    "hidden_size": 2**20,
    "vocab_size": 2**24,
}
_OPTIONAL_INTS = {
    "num_key_value_heads": 2**12,
    "head_dim": 2**16,
    "intermediate_size": 2**22,
    "max_position_embeddings": 2**24,
}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the converters use, all checked."""

    path: Path
    model_type: str
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    intermediate_size: int | None
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    name: str

    def require_intermediate_size(self) -> int:
        if self.intermediate_size is None:
            raise ConversionError(f"{self.path}: intermediate_size is missing")
        return self.intermediate_size


def read_model_config(path: Path) -> ModelConfig:
    """Read and check ``path`` (a checkpoint's config.json); ConversionError names the field."""
    if not path.is_file():
        raise ConversionError(f"{path} is missing: not a Hugging Face model folder")
    raw = read_json_object(path)
    ints = {key: _int_field(path, raw, key, limit, True) for key, limit in _REQUIRED_INTS.items()}
    ints |= {key: _int_field(path, raw, key, limit, False) for key, limit in _OPTIONAL_INTS.items()}
    heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
    kv_heads = ints["num_key_value_heads"] or heads
    if kv_heads > heads or heads % kv_heads:
        raise ConversionError(
            f"{path}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}"
        )
    head_dim = ints["head_dim"] or _default_head_dim(path, hidden, heads)
    if head_dim % 2:
        given = "" if ints["head_dim"] else f" (hidden_size/num_attention_heads: {hidden}/{heads})"
        raise ConversionError(f"{path}: head_dim={head_dim}{given} must be even (rotary pairs)")
    rope = _object_field(path, raw, "rope_parameters") or {}
    return ModelConfig(
        path=path,
        model_type=_model_type(path, raw),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=hidden,
        head_dim=head_dim,
        num_hidden_layers=ints["num_hidden_layers"],
        vocab_size=ints["vocab_size"],
        intermediate_size=ints["intermediate_size"],
        max_position_embeddings=ints["max_position_embeddings"] or 2048,
        rope_theta=_rope_theta(path, raw, rope),
        rms_norm_eps=_float_field(path, raw, "rms_norm_eps", 1e-6, upper=1.0),
        rope_scaling=_rope_scaling(path, raw, rope),
        tie_word_embeddings=_bool_field(path, raw, "tie_word_embeddings"),
        eos_token_ids=token_ids(path, raw, "eos_token_id"),
        name=raw["_name_or_path"] if isinstance(raw.get("_name_or_path"), str) else "",
    )


def read_json_object(
    path: Path, *, required: bool = True, max_bytes: int = _MAX_BYTES
) -> dict[str, Any]:
    """The JSON object in ``path`` ({} for a missing optional file); ConversionError for a
    missing required file, an oversized or unreadable one, bad JSON or another JSON type."""
    if not path.is_file():
        if required:
            raise ConversionError(f"{path} is missing")
        return {}
    try:
        if path.stat().st_size > max_bytes:
            raise ConversionError(f"{path} is larger than {max_bytes >> 20} MB")
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise ConversionError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(path: Path, raw: dict[str, Any], key: str, limit: int, required: bool) -> int:
    """A whole number in 1..limit; 0 for an optional field that is absent or null."""
    value = raw.get(key)
    if value is None:
        if required:
            raise ConversionError(f"{path}: {key} is missing")
        return 0
    if not _is_int(value) or not 1 <= value <= limit:
        raise ConversionError(
            f"{path}: {key} must be a whole number from 1 to {limit}, not {value!r:.40}"
        )
    return int(value)


def _float_field(
    path: Path, raw: dict[str, Any], key: str, default: float, *, upper: float = math.inf
) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConversionError(f"{path}: {key} must be a number, not {value!r:.40}")
    if not (math.isfinite(value) and 0 < value < upper):
        raise ConversionError(f"{path}: {key}={value!r} is out of range (0, {upper})")
    return float(value)


def _bool_field(path: Path, raw: dict[str, Any], key: str) -> bool:
    value = raw.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConversionError(f"{path}: {key} must be true or false, not {value!r:.40}")
    return value


def _object_field(path: Path, raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        raise ConversionError(f"{path}: {key} must be a JSON object or null, not {value!r:.40}")
    return value or None


def _model_type(path: Path, raw: dict[str, Any]) -> str:
    value = raw.get("model_type")
    if not isinstance(value, str) or not value.strip():
        raise ConversionError(f"{path}: model_type is missing or not a name ({value!r:.40})")
    return value


def _default_head_dim(path: Path, hidden: int, heads: int) -> int:
    if hidden % heads:
        raise ConversionError(
            f"{path}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
            "and no head_dim is given"
        )
    return hidden // heads


def _rope_theta(path: Path, raw: dict[str, Any], rope: dict[str, Any]) -> float:
    if raw.get("rope_theta") is None and rope.get("rope_theta") is not None:
        return _float_field(path, rope, "rope_theta", 10000.0)
    return _float_field(path, raw, "rope_theta", 10000.0)


def _rope_scaling(path: Path, raw: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any] | None:
    scaling = _object_field(path, raw, "rope_scaling")
    if scaling is None and rope.get("rope_type") not in (None, "default"):
        return rope  # transformers 5 keeps the scaling among the rope parameters
    return scaling


def token_ids(path: Path, raw: dict[str, Any], key: str) -> tuple[int, ...]:
    """``raw[key]`` as token ids: absent/null, one id, or a list of ids."""
    value = raw.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(_is_int(v) and 0 <= v < 2**31 for v in values):
        raise ConversionError(
            f"{path}: {key} must be a token id or a list of them, not {value!r:.40}"
        )
    return tuple(values)
