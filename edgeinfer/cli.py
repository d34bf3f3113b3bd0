"""The ``edgeinfer`` command: run, chat, models, devices, convert, bench.

Every EdgeInferError becomes one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import __version__, catalog, devices_cli
from .bench import cli as bench_cli
from .errors import EdgeInferError, InvalidRequestError
from .serve import cli as serve_cli

logger = logging.getLogger("edgeinfer")

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
_MAX_SCHEMA_BYTES = 1 << 20  # a --json-schema file; the structured-output bounds apply after


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--device",
        default="auto",
        help="auto | cpu | cuda | metal | npu | gpu | directml | an ONNX Runtime provider "
        "name (default: auto; 'edgeinfer devices MODEL' shows the plan)",
    )
    g.add_argument(
        "--allow-fallback",
        action="store_true",
        help="run on the CPU when --device is not available instead of failing",
    )
    g.add_argument(
        "--context-length",
        type=int,
        metavar="N",
        help="tokens the KV cache holds (default: the largest that fits the memory budget, "
        "at most the model's trained context)",
    )
    g.add_argument("--threads", type=int, metavar="N", help="compute threads (default: cores)")
    g.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="most memory the process may use, e.g. 512MB or 1.5GiB (default: what it uses "
        "now plus half of the available RAM); the context is sized to fit",
    )
    g.add_argument(
        "--context-overflow",
        choices=("stop", "slide"),
        default="stop",
        help="when a reply fills the context: stop (default) or slide (keep the system "
        "prompt and the newer half of the conversation)",
    )


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "-n",
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="most tokens to generate (default: 256)",
    )
    g.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, metavar="K", help="0 = off (default: 40)")
    g.add_argument("--top-p", type=float, metavar="P", help="1 = off (default: 0.95)")
    g.add_argument("--min-p", type=float, metavar="P", help="0 = off (default: 0)")
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="1 = off (default: 1)")
    g.add_argument("--seed", type=int, metavar="S", help="same seed, same output")
    g.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop before this text (repeatable)"
    )
    s = p.add_argument_group("structured output (needs edgeinfer[structured])")
    x = s.add_mutually_exclusive_group()
    x.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer with JSON that validates against the JSON schema in FILE",
    )
    x.add_argument("--regex", metavar="PATTERN", help="answer with text matching PATTERN")
    x.add_argument("--choice", metavar="A,B,C", help="answer with exactly one of these")


def _add_chat_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        help="chat format for a model that has none: chatml, llama3, gemma, or a Jinja file "
        "(default: the model's own)",
    )


def prepare_chat(model: Any, args: argparse.Namespace) -> None:
    """Set --chat-template, or refuse a model without a template before anything is asked."""
    from .chat import BUILTIN_TEMPLATES, resolve_chat_template

    if args.chat_template:
        model.use_chat_template(resolve_chat_template(args.chat_template))
    elif model.chat_template is None:
        raise InvalidRequestError(
            f"{args.model} has no chat template; pass --chat-template with one of "
            f"{', '.join(BUILTIN_TEMPLATES)} or a Jinja file, or complete plain text with "
            f"'edgeinfer run {args.model} -p TEXT'"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeinfer",
        description="Run language models on this machine, offline.",
        epilog="Models live in $EDGEINFER_HOME (default ~/.cache/edgeinfer).",
    )
    parser.add_argument("--version", action="version", version=f"edgeinfer {__version__}")
    parser.add_argument("--debug", action="store_true", help="log everything, tracebacks")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what edgeinfer does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="complete one prompt; the text alone goes to stdout",
        description="Complete PROMPT and stream the text to stdout.",
    )
    run.add_argument("model", metavar="MODEL", help="catalog name, .gguf file or model folder")
    run.add_argument("-p", "--prompt", required=True, help="the prompt ('-' reads stdin)")
    run.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message through the model's chat template",
    )
    _add_chat_template_flag(run)
    run.add_argument("--stats", action="store_true", help="print timing figures on stderr")
    run.add_argument("--json", action="store_true", help="print one JSON object instead")
    _add_sampling_flags(run)
    _add_model_flags(run)

    chat = sub.add_parser(
        "chat",
        help="talk with a model in the terminal",
        description="Interactive chat. /reset, /stats, /exit; Ctrl-C stops a reply, Ctrl-D quits.",
    )
    chat.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        default=catalog.DEFAULT_MODEL,
        help=f"catalog name, .gguf file or model folder (default: {catalog.DEFAULT_MODEL})",
    )
    chat.add_argument("--system", metavar="TEXT", help="system message for the conversation")
    _add_chat_template_flag(chat)
    _add_sampling_flags(chat)
    _add_model_flags(chat)

    _add_convert_parser(sub)
    devices_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    serve_cli.add_parser(sub, _add_model_flags)

    models = sub.add_parser("models", help="list, fetch or locate catalog models")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    msub.add_parser("list", help="catalog entries and which are present")
    fetch = msub.add_parser("fetch", help="download a catalog model into $EDGEINFER_HOME")
    fetch.add_argument("name", metavar="NAME")
    fetch.add_argument("--force", action="store_true", help="fetch again even if present")
    path = msub.add_parser("path", help="print the local path of a catalog model")
    path.add_argument("name", metavar="NAME")
    return parser


def _add_convert_parser(sub: Any) -> None:
    from .converters.config import BUILDERS, GGUF_QUANTS, ONNX_QUANTS

    p = sub.add_parser(
        "convert",
        help="export and quantize a model to ONNX or GGUF, validated against its source",
        description="Convert SRC (a .gguf file or a Hugging Face folder with safetensors) into "
        "OUT: an ONNX model folder or one GGUF file. A GGUF SRC goes to ONNX through the native "
        "builder (no torch; its blocks kept exactly, tokenizer.json written from the file's "
        "vocabulary, both checked against llama.cpp on SRC); a Hugging Face folder through "
        "optimum. The result is compared with the source on fixed prompts; below the "
        "thresholds the conversion fails and OUT is not written. GGUF results get a report "
        "beside them, OUT.json.",
    )
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
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept .bin/.pt pickle weights (they can run code: trusted files only)",
    )
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
    p.add_argument(
        "--min-top1",
        type=float,
        default=0.90,
        metavar="X",
        help="least top-1 agreement with the source (default: 0.90)",
    )
    p.add_argument(
        "--min-greedy",
        type=float,
        default=0.60,
        metavar="X",
        help="least greedy-continuation agreement (default: 0.60)",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads for export and checks (default: the engines' own choice)",
    )


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "seed",
        "stop",
    )
    kwargs = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    response_format = _response_format(args)
    if response_format is not None:
        kwargs["response_format"] = response_format
    return kwargs


def _response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    if getattr(args, "json_schema", None):
        from .bounded_json import read_json_file

        path = Path(args.json_schema)
        schema = read_json_file(path, max_bytes=_MAX_SCHEMA_BYTES, error=InvalidRequestError)
        return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}
    if getattr(args, "regex", None):
        return {"type": "regex", "pattern": args.regex}
    if getattr(args, "choice", None):
        choices = [c for c in args.choice.split(",") if c]
        return {"type": "choice", "choices": choices}
    return None


def load_model(args: argparse.Namespace) -> Any:
    from .loader import load

    return load(
        args.model,
        device=args.device,
        allow_fallback=args.allow_fallback,
        memory_budget=args.memory_budget,
        context_overflow=args.context_overflow,
        context_length=args.context_length,
        threads=args.threads,
    )


def format_stats(stats: Any, finish_reason: str) -> str:
    return (
        f"prompt {stats.prompt_tokens} tok (reused {stats.reused_prompt_tokens}), "
        f"completion {stats.completion_tokens} tok, ttft {stats.ttft_s * 1000:.0f} ms, "
        f"prefill {stats.prefill_tokens_per_s:.0f} tok/s, "
        f"decode {stats.decode_tokens_per_s:.1f} tok/s, finish {finish_reason}"
    )


def cmd_run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    kwargs = sampling_kwargs(args)
    with load_model(args) as model:
        if args.chat:
            prepare_chat(model, args)
            stream = model.chat([{"role": "user", "content": prompt}], stream=True, **kwargs)
        else:
            stream = model.stream(prompt, **kwargs)
        with stream:
            for chunk in stream:
                if not args.json and chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        result = stream.result
        assert result is not None
        if args.json:
            json.dump(
                {
                    "model": args.model,
                    "text": result.text,
                    "token_ids": list(result.token_ids),
                    "finish_reason": result.finish_reason,
                    "stats": asdict(result.stats),
                    "memory_plan": model.info.get("memory_plan"),
                },
                sys.stdout,
                ensure_ascii=False,
            )
            sys.stdout.write("\n")
        elif not result.text.endswith("\n"):
            sys.stdout.write("\n")  # the output ends with a newline, as a line of text
        if args.stats:
            print(format_stats(result.stats, result.finish_reason), file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.models_command == "list":
        print(f"{'NAME':<28} {'KIND':<5} {'SIZE':>7}  {'STATUS':<11}  DESCRIPTION")
        for listed in catalog.CATALOG.values():
            present = "present" if catalog.is_present(listed) else "not fetched"
            size = f"{listed.size / 1e6:.0f} MB" if listed.size else ""
            row = f"{listed.name:<28} {listed.format:<5} {size:>7}  {present:<11}"
            print(f"{row}  {listed.description}")
        return 0
    entry = catalog.lookup(args.name)
    if entry is None:
        raise InvalidRequestError(
            f"{args.name!r} is not in the catalog; see 'edgeinfer models list'"
        )
    if args.models_command == "fetch":
        print(catalog.fetch(args.name, force=args.force))
        return 0
    if not catalog.is_present(entry):
        raise InvalidRequestError(
            f"{args.name} is not fetched yet; run 'edgeinfer models fetch {args.name}'"
        )
    print(catalog.local_path(entry))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .converters import ConvertConfig, convert_with

    cfg = ConvertConfig(
        src=args.src,
        out=args.output,
        to=args.to,
        builder=args.builder,
        quant=args.quant,
        head_bits=8 if args.head_8bit else None,
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


class _Speaker(logging.Formatter):
    """Each line says who said it: the engines' own log lines are not edgeinfer's."""

    def format(self, record: logging.LogRecord) -> str:
        who = "llama.cpp" if record.name.endswith("llama_cpp.engine") else "edgeinfer"
        return f"{who}: {record.getMessage()}"


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Speaker())
    logging.basicConfig(level=level, handlers=[handler])
    if not args.debug:  # the engine's own log is only for --debug
        logging.getLogger("edgeinfer.runtimes.llama_cpp.engine").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args)
    from .chat_cli import cmd_chat

    commands = {
        "run": cmd_run,
        "chat": cmd_chat,
        "models": cmd_models,
        "convert": cmd_convert,
        "devices": devices_cli.cmd_devices,
        "bench": bench_cli.cmd_bench,
        "serve": lambda a: serve_cli.cmd_serve(a, load_model),
    }
    try:
        return commands[args.command](args)
    except EdgeInferError as exc:
        if args.debug:
            raise
        print(f"edgeinfer: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (| head): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit-time flush does not fail again
        return 0


if __name__ == "__main__":
    sys.exit(main())
