"""ConvertConfig: one conversion's settings, validated before any work starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import ConversionError
from edgeinfer.files.manifest import KV_DTYPES

__all__ = [
    "BUILDERS",
    "GGUF_QUANTS",
    "NATIVE_QUANTS",
    "ONNX_QUANTS",
    "ConvertConfig",
    "is_gguf_file",
]

ONNX_QUANTS = ("keep", "fp32", "fp16", "int8", "int8wo", "int4")
NATIVE_QUANTS = ("keep", "int4", "int8", "fp32")  # what the native builder writes
BUILDERS = ("native", "optimum")
# f32/f16/bf16/q8_0 are written directly; the others by llama.cpp's quantizer from f16
GGUF_QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_k_m", "q4_k_m", "q6_k")
_DEFAULT_QUANT = {"onnx": "int8", "gguf": "f16"}
_GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """A file that starts like a GGUF (the magic, not the name, decides)."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == _GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class ConvertConfig:
    src: Path
    out: Path
    to: str | None = None  # None: gguf when OUT ends in .gguf, else onnx
    quant: str | None = None  # None: keep (native), int8 (optimum) for ONNX; f16 for GGUF
    # ONNX: "native" (GGUF sources: contrib-operator graph, no torch) or "optimum" (export
    # through torch); None picks native for a GGUF source, optimum for a Hugging Face folder
    builder: str | None = None
    head_bits: int | None = None  # native int4: the embedding and output projection at 8 bits
    kv_dtype: str = "float32"  # native: the graph's KV cache (past/present) element type
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
        if self.to is None:
            object.__setattr__(self, "to", "gguf" if self.out.suffix.lower() == ".gguf" else "onnx")
        if self.to not in _DEFAULT_QUANT:
            raise ConversionError(f"--to {self.to!r} is not supported; use onnx or gguf")
        self._pick_builder()
        if self.quant is None:
            default = "keep" if self.builder == "native" else _DEFAULT_QUANT[str(self.to)]
            object.__setattr__(self, "quant", default)
        if self.builder == "native":
            allowed: tuple[str, ...] = NATIVE_QUANTS
        elif self.to == "onnx":
            allowed = tuple(q for q in ONNX_QUANTS if q != "keep")
        else:
            allowed = GGUF_QUANTS
        if self.quant not in allowed:
            what = (
                "written by the native ONNX builder"
                if self.builder == "native"
                else ("an ONNX quantization" if self.to == "onnx" else "a GGUF quantization")
            )
            hint = (
                " (keep is the native builder's, for a GGUF source)" if self.quant == "keep" else ""
            )
            raise ConversionError(
                f"--quant {self.quant!r} is not {what}; use one of {', '.join(allowed)}{hint}"
            )
        if self.head_bits is not None and (self.builder != "native" or self.quant != "int4"):
            raise ConversionError("--head-8bit applies to --quant int4 of the native builder")
        if self.kv_dtype not in KV_DTYPES:
            raise ConversionError(f"--kv-dtype {self.kv_dtype!r}: use {' or '.join(KV_DTYPES)}")
        if self.kv_dtype != "float32" and (self.to != "onnx" or self.builder != "native"):
            raise ConversionError(
                "--kv-dtype float16 is a graph of the native ONNX builder (--to onnx --builder "
                "native); llama.cpp picks its cache type at load (load(kv_dtype=...))"
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

    def _pick_builder(self) -> None:
        gguf_src = is_gguf_file(self.src)
        if self.builder is not None and self.builder not in BUILDERS:
            raise ConversionError(f"--builder {self.builder!r}: use native or optimum")
        if self.to == "gguf":
            if self.builder is not None:
                raise ConversionError("--builder applies to --to onnx only")
            return
        if self.builder is None:
            object.__setattr__(self, "builder", "native" if gguf_src else "optimum")
        elif self.builder == "native" and not (gguf_src or self.src.is_dir()):
            raise ConversionError(
                f"{self.src}: the native ONNX builder reads a GGUF file or a Hugging Face "
                "folder with safetensors weights"
            )
