"""ConvertConfig: one conversion's settings, validated before any work starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import ConversionError

__all__ = ["GGUF_QUANTS", "ONNX_QUANTS", "ConvertConfig"]

ONNX_QUANTS = ("fp32", "fp16", "int8", "int8wo", "int4")
# f32/f16/bf16/q8_0 are written directly; the others by llama.cpp's quantizer from f16
GGUF_QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_k_m", "q4_k_m", "q6_k")
_DEFAULT_QUANT = {"onnx": "int8", "gguf": "f16"}


@dataclass(frozen=True)
class ConvertConfig:
    src: Path
    out: Path
    to: str = "onnx"
    quant: str | None = None  # None: int8 for ONNX, f16 for GGUF
    overwrite: bool = False
    allow_pickle: bool = False  # load .bin/.pt weights (pickle can run code: trusted files only)
    # int4 (MatMulNBits): blocks of 32 weights with a zero point each. Asymmetric blocks keep
    # the answers of already-quantized sources (symmetric int4 of the Q4_1 default model
    # changed its greedy answer to "The capital of France is").
    int4_block_size: int = 32
    int4_symmetric: bool = False
    int4_accuracy_level: int | None = None  # ORT: 0/None unset, 1 fp32, 2 fp16, 3 bf16, 4 int8
    # validation: the conversion fails when the result agrees less than this with the source
    min_top1_agreement: float = 0.90
    min_greedy_agreement: float = 0.60
    validation_tokens: int = 16
    threads: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", Path(self.src).expanduser())
        object.__setattr__(self, "out", Path(self.out).expanduser())
        if self.to not in _DEFAULT_QUANT:
            raise ConversionError(f"--to {self.to!r} is not supported; use onnx or gguf")
        if self.quant is None:
            object.__setattr__(self, "quant", _DEFAULT_QUANT[self.to])
        allowed = ONNX_QUANTS if self.to == "onnx" else GGUF_QUANTS
        if self.quant not in allowed:
            raise ConversionError(
                f"--quant {self.quant!r} is not a {self.to.upper()} quantization; use one of "
                f"{', '.join(allowed)}"
            )
        if self.int4_block_size not in (16, 32, 64, 128, 256):
            raise ConversionError("int4 block size must be 16, 32, 64, 128 or 256")
        if self.int4_accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise ConversionError("int4 accuracy level must be 0, 1, 2, 3 or 4")
        for name in ("min_top1_agreement", "min_greedy_agreement"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConversionError(f"{name}={value} must be between 0 and 1")
        if not 1 <= self.validation_tokens <= 256:
            raise ConversionError("validation_tokens must be between 1 and 256")
        if self.src.resolve() == self.out.resolve():
            raise ConversionError("the output must not be the source")
