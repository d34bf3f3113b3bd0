"""The one frozen context every graph function takes, and the report it fills."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.files.gguf_file import TensorInfo
from edgeinfer.files.manifest import KV_DTYPES  # the KV cache's element types (past/present)

from .arch import Arch, Shape
from .graph import Graph
from .tensors import TensorSource

__all__ = ["KV_DTYPES", "QUANTS", "BuildContext", "BuildReport", "Quant", "check_kv_dtype"]

QUANTS = ("keep", "int4", "int8", "fp32")  # keep: the GGUF's own blocks, exactly


@dataclass
class BuildReport:
    architecture: str
    layers: int
    nbits: dict[str, int]  # "4-bit/32" -> tensors
    widened: dict[str, str]  # tensor -> why it is stored as floats
    max_context: int
    shape: Shape
    kv_dtype: str = "float32"

    def count_blocks(self, bits: int, block_size: int) -> None:
        key = f"{bits}-bit/{block_size}"
        self.nbits[key] = self.nbits.get(key, 0) + 1


@dataclass(frozen=True)
class Quant:
    """How projections are stored: ``keep`` the source's blocks, re-round to ``int4``/``int8``
    (``head_bits`` for the embedding and the output projection), or ``fp32`` everywhere."""

    mode: str
    head_bits: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in QUANTS:
            raise ConversionError(
                f"the native builder writes --quant {', '.join(QUANTS)}, not {self.mode!r}"
            )
        if self.head_bits not in (None, 4, 8):
            raise ConversionError(f"head_bits={self.head_bits!r}: use 4 or 8")

    @property
    def bits(self) -> int | None:
        """The re-rounding width, None when the source's weights are kept or widened."""
        return {"int4": 4, "int8": 8}.get(self.mode)

    def bits_for(self, name: str) -> int | None:
        """The re-rounding width of tensor ``name`` (the embedding and the output projection
        may have their own), None when nothing is re-rounded."""
        if self.bits is None or name not in ("output.weight", "token_embd.weight"):
            return self.bits
        return self.head_bits or self.bits


def check_kv_dtype(kv_dtype: object) -> str:
    """``kv_dtype`` if the builder writes it; ConversionError naming the choices otherwise."""
    if isinstance(kv_dtype, str) and kv_dtype in KV_DTYPES:
        return kv_dtype
    raise ConversionError(
        f"kv_dtype={kv_dtype!r}: the native builder writes {' or '.join(KV_DTYPES)}"
    )


@dataclass(frozen=True)
class BuildContext:
    """What every graph function reads. The graph and the report are the objects being
    written; nothing else changes during a build."""

    tensors: TensorSource
    shape: Shape
    arch: Arch
    quant: Quant
    context: int  # positions the rotary caches cover
    graph: Graph
    report: BuildReport
    kv_dtype: str = "float32"  # float16: attention runs on halves, the cache takes half

    def need(self, name: str) -> TensorInfo:
        t = self.tensors.info(name)
        if t is None:
            raise ConversionError(f"{self.tensors.header.path.name}: tensor {name} is missing")
        return t

    def floats(self, name: str) -> np.ndarray:
        return self.tensors.floats(self.need(name))
