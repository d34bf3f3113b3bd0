"""``edgeinfer convert SRC -o OUT``: export and quantize a model to ONNX or GGUF, validated
against its source (the converters do the work; this module holds the flags)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..files.manifest import KV_DTYPES

_DESCRIPTION = (
    "Convert SRC (a .gguf file or a Hugging Face folder with safetensors) into "
    "OUT: an ONNX model folder or one GGUF file. A GGUF SRC goes to ONNX through the native "
    "builder (no torch; its blocks kept exactly, tokenizer.json written from the file's "
    "vocabulary, both checked against llama.cpp on SRC); a Hugging Face folder through "
    "optimum. The result is compared with the source on fixed prompts and the agreement "
    "it measured is printed; below the thresholds the conversion fails and OUT is not "
    "written. GGUF results get a report beside them, OUT.json."
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "convert",
        help="export and quantize a model to ONNX or GGUF, validated against its source",
        description=_DESCRIPTION,
    )
    _add_output_flags(p)
    _add_optimum_int4_flags(p)
    _add_check_flags(p)


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """What to read and what to write: format, builder, quantization."""
    from ..converters.config import BUILDERS, GGUF_QUANTS, ONNX_QUANTS

    p.add_argument("src", metavar="SRC", help=".gguf file or Hugging Face model folder")
    p.add_argument(
        "-o", "--output", required=True, metavar="OUT", help="output folder (ONNX) or file (GGUF)"
    )
    p.add_argument(
        "--to",
        choices=["onnx", "gguf"],
        help="target format (default: gguf when OUT ends in .gguf, else onnx)",
    )
    p.add_argument(
        "--builder",
        choices=list(BUILDERS),
        help="ONNX: native (contrib-operator graph, no torch; the default for a GGUF) or "
        "optimum (export with torch, needs edgeinfer[convert]; the default for a Hugging Face "
        "folder, which the native builder also reads: Llama, Mistral, Qwen2, Gemma 3)",
    )
    p.add_argument(
        "--quant",
        choices=[*ONNX_QUANTS, *(q for q in GGUF_QUANTS if q not in ONNX_QUANTS)],
        help="native builder: keep (the default: the GGUF's blocks, lossless), int4, int8 "
        "(re-rounded symmetric blocks), fp32. optimum: fp32; fp16 (GPU); int8 (dynamic, "
        "weights and activations; its default); int8wo (8-bit weight-only); int4 (4-bit "
        "weight-only). GGUF: f32, f16 (the default), bf16, q8_0 written directly; q4_0, "
        "q4_1, q5_k_m, q4_k_m, q6_k by llama.cpp",
    )
    p.add_argument(
        "--head-8bit",
        action="store_true",
        help="native --quant int4: keep the embedding and the output projection at 8 bits",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="float32",
        help="native builder: the graph's KV cache type; float16 halves the cache's memory "
        "(attention computed on halves; validated like any conversion)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept .bin/.pt pickle weights (they can run code: trusted files only)",
    )


def _add_optimum_int4_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--int4-block-size",
        type=int,
        default=32,
        metavar="N",
        help="optimum int4: weights per quantization block, 16/32/64/128/256 (default: 32)",
    )
    p.add_argument(
        "--int4-symmetric",
        action="store_true",
        help="optimum int4: symmetric blocks (default: asymmetric, with zero points)",
    )
    p.add_argument(
        "--int4-accuracy-level",
        type=int,
        metavar="L",
        help="optimum int4: MatMulNBits compute, 1 fp32, 2 fp16, 3 bf16, 4 int8 (default: "
        "onnxruntime's, unset)",
    )


def _add_check_flags(p: argparse.ArgumentParser) -> None:
    """How close to its source the result must answer, and the threads to check it with."""
    p.add_argument(
        "--min-top1",
        type=float,
        default=0.90,
        metavar="X",
        help="least top-1 agreement with the source where it is decisive (its top token "
        "leads the runner-up by more than 0.5 nats; near-ties do not count) (default: 0.90)",
    )
    p.add_argument(
        "--min-greedy",
        type=float,
        default=0.60,
        metavar="X",
        help="least greedy-continuation agreement, a parting at a near-tie counting as "
        "agreement (default: 0.60); 0 for both: keep whatever the check measures",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads for export and checks (default: the engines' own choice)",
    )


def cmd_convert(args: argparse.Namespace) -> int:
    from ..converters import ConvertConfig, convert_with

    cfg = ConvertConfig(
        src=args.src,
        out=args.output,
        to=args.to,
        builder=args.builder,
        quant=args.quant,
        head_bits=8 if args.head_8bit else None,
        kv_dtype=args.kv_dtype,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle,
        int4_block_size=args.int4_block_size,
        int4_symmetric=args.int4_symmetric,
        int4_accuracy_level=args.int4_accuracy_level,
        min_top1_agreement=args.min_top1,
        min_greedy_agreement=args.min_greedy,
        threads=args.threads,
    )
    result = convert_with(cfg, on_stage=lambda line: print(line, file=sys.stderr, flush=True))
    print(result.path)
    return 0
