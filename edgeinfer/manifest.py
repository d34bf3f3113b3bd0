"""``edgeinfer.json``: what a converted model folder holds, written by the converters and read
by the runtimes and the memory planner. Only the standard library is needed to read it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

__all__ = ["MANIFEST_NAME", "PARTIAL_MARKER", "Architecture", "Manifest"]

MANIFEST_NAME = "edgeinfer.json"
PARTIAL_MARKER = ".edgeinfer-partial"  # present only in an unfinished conversion's folder
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Architecture:
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context: int
    vocab_size: int
    kv_dtype: str = "float32"  # element type of the KV cache the graph takes and returns


@dataclass(frozen=True)
class Manifest:
    format: str  # "onnx"
    model_file: str
    architecture: Architecture
    tokenizer_file: str = "tokenizer.json"
    chat_template_file: str | None = "chat_template.jinja"
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    has_position_ids: bool = True
    source: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def write(self, folder: Path) -> None:
        data = asdict(self)
        (folder / MANIFEST_NAME).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST_NAME
        if (folder / PARTIAL_MARKER).exists():
            raise ModelLoadError(
                f"{folder} is an unfinished conversion (interrupted or failed); delete it and "
                "convert again"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            version = int(data.get("format_version", 0))
            if version > FORMAT_VERSION:
                raise ModelLoadError(
                    f"{path} was written by a newer edgeinfer (format {version}); upgrade"
                )
            data["architecture"] = Architecture(**data["architecture"])
            data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
            return cls(**data)
        except ModelLoadError:
            raise
        except FileNotFoundError as exc:
            raise ModelLoadError(
                f"{folder} has no {MANIFEST_NAME}: convert the model with 'edgeinfer convert'"
            ) from exc
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ModelLoadError(f"{path} is damaged: {exc}") from exc
