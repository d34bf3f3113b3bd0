"""``edgeinfer bench MODEL [MODEL ...]``: prompt processing and generation speed, time to
first token and peak memory on this machine, beside the peers installed (``--compare``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..bench.embed import cmd_bench_embed, is_embedding_model
from ..bench.plot import plot_missing_message
from ..bench.records import BenchResultError
from ..bench.report import BenchReport
from ..bench.runner import DEFAULT_RUN_TIMEOUT_S, BenchSettings, ProgressLine, run_bench
from ..bounded_json import read_json_file
from ..errors import InvalidRequestError
from .common import EXIT_INTERRUPTED, MODEL_HELP

_DESCRIPTION = (
    "For each MODEL and each combination of prompt length and thread count: "
    "prompt processing (pp) and token generation (tg) tokens/s, time to first token, the "
    "peak resident memory of the process and the memory plan's total. Each run is a fresh "
    "process; the workload is the same prompt token ids for every engine, greedy, with "
    "the end-of-generation tokens banned so every run generates -n tokens. --compare runs "
    "the same workload through the peers installed here (llama-cpp-python for a GGUF, "
    "optimum for an ONNX folder with config.json, onnxruntime-genai for a folder its "
    "builder made), interleaved round by round, with each row's ratio to edgeinfer. "
    "--parallel N[,N...] runs N streams at once on a model loaded with parallel=N instead "
    "(aggregate and per-stream decode tokens/s, TTFT p50/p95, and the TTFT of a request "
    "joining N-1 running streams); its peer is onnxruntime-genai's continuous-batching "
    "og.Engine."
)
MAX_SAVED_BYTES = 256 * 2**20  # a saved result: its runs' figures, no prompts


def int_list(flag: str, text: str) -> tuple[int, ...]:
    """``"128,512"`` -> ``(128, 512)``; an empty or malformed list names the flag."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if not text.strip() or any(not p for p in parts):
            raise ValueError
        return tuple(int(p) for p in parts)
    except ValueError:
        raise InvalidRequestError(
            f"{flag} {text!r} is invalid: expected whole numbers separated by commas, e.g. 128,512"
        ) from None


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure speed and memory of models on this machine, beside the peers",
        description=_DESCRIPTION,
        epilog="Example: edgeinfer bench smollm2-135m-instruct -p 128,512 -n 128 -r 5 --compare; "
        "edgeinfer bench smollm2-135m-instruct -p 128 --parallel 1,2,4,8 --compare "
        "--peer-model GENAI_FOLDER",
    )
    p.add_argument("models", nargs="*", metavar="MODEL", help=MODEL_HELP)
    _add_workload_flags(p)
    _add_engine_flags(p)
    _add_peer_flags(p)
    _add_output_flags(p)


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    """What every engine is asked to do, and how often."""
    p.add_argument(
        "-p",
        "--prompt-tokens",
        default="128,512",
        metavar="N[,N...]",
        help="prompt lengths in tokens (default: 128,512)",
    )
    p.add_argument(
        "-n",
        "--new-tokens",
        type=int,
        default=128,
        metavar="N",
        help="tokens to generate after each prompt (default: 128)",
    )
    p.add_argument(
        "-r",
        "--repetitions",
        type=int,
        default=5,
        metavar="N",
        help="measured runs per configuration and engine (default: 5)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="runs before the measured ones, not counted (default: 1)",
    )
    p.add_argument(
        "--parallel",
        default=None,
        metavar="N[,N...]",
        help="streams at once, e.g. 1,2,4,8: each N loads the model with parallel=N and runs "
        "N concurrent streams (default: one stream, the classic run)",
    )
    p.add_argument(
        "--threads",
        default=None,
        metavar="N[,N...]",
        help="compute thread counts, the same for every engine (default: the physical cores)",
    )


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """How edgeinfer loads the model (the peers follow what it chose)."""
    p.add_argument(
        "--device",
        default="auto",
        help="edgeinfer's device (as for run); peers use the device edgeinfer chose "
        "(default: auto)",
    )
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="edgeinfer's memory budget, e.g. 512MB; the plan's total is shown beside the "
        "measured peak (default: load()'s)",
    )
    p.add_argument(
        "--engine",
        default="auto",
        choices=("auto", "llama.cpp", "onnxruntime"),
        help="what runs a GGUF for edgeinfer, as load()'s engine=: auto (its route rule: a "
        "catalog GGUF at --parallel > 1 runs its exact ONNX transcode on the CPU), llama.cpp, "
        "or onnxruntime (catalog names only) (default: auto)",
    )
    p.add_argument(
        "--speculative",
        default="off",
        metavar="MODE",
        help="edgeinfer's speculative decoding, as load()'s speculative=: off, auto, lookup, "
        "lookup:N or draft:MODEL[:N]; the table gains an 'accepted' column (drafted tokens "
        "the model kept). The workload's prompt repeats itself, so lookup finds more to copy "
        "than in real text (default: off)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        metavar="N",
        help="context for every engine (default: the longest prompt plus -n, rounded up to "
        "256, at least 1024)",
    )


def _add_peer_flags(p: argparse.ArgumentParser) -> None:
    """Which peers run beside edgeinfer, and how long one run may take."""
    p.add_argument(
        "--compare",
        action="store_true",
        help="run the peers installed here beside edgeinfer; a missing one is skipped with "
        "how to add it",
    )
    p.add_argument(
        "--peer-model",
        action="append",
        default=[],
        metavar="PATH",
        help="a peer's own file or folder of the same model, run beside every MODEL "
        "(repeatable): an onnxruntime-genai folder, an optimum export, a .gguf; it takes the "
        "place of MODEL for that peer",
    )
    p.add_argument(
        "--agreement",
        action="store_true",
        help="also measure each row's answers against a reference, llama.cpp on the model's "
        "GGUF (or --reference), in the same run: teacher-forced top-1 agreement and the "
        "greedy prefix before the first divergence, on the conversion check's prompts",
    )
    p.add_argument(
        "--reference",
        type=Path,
        metavar="FILE.gguf",
        help="--agreement's reference when MODEL is no GGUF (an ONNX folder of it, say)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_RUN_TIMEOUT_S,
        metavar="SECONDS",
        help="the longest one run (one process) may take; a peer that takes longer is "
        "stopped, with what it started, and left out with a note (default: "
        f"{DEFAULT_RUN_TIMEOUT_S:g})",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Where the figures come from and how they are shown."""
    p.add_argument(
        "--from",
        dest="saved",
        type=Path,
        metavar="FILE.json",
        help="print (or --plot) a result saved with --json again instead of measuring",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object instead")
    out.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="also draw decode tok/s and peak RSS per configuration (needs matplotlib)",
    )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InvalidRequestError(plot_missing_message()) from None
        if not args.plot.parent.is_dir():
            raise InvalidRequestError(
                f"--plot {args.plot}: folder {args.plot.parent} does not exist"
            )
    if args.saved is None and args.models and all(map(is_embedding_model, args.models)):
        return cmd_bench_embed(args)  # texts/s of embedding models (bench/embed.py)
    if args.saved is not None:
        if args.models:
            raise InvalidRequestError("--from prints a saved result: name no MODEL with it")
        report = _read_saved(args.saved)
    else:
        report = _measure(args)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(report.text(markdown=args.markdown))
    sys.stdout.flush()
    if args.plot is not None and report.measured():
        report.plot(args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if report.interrupted:
        return EXIT_INTERRUPTED
    if report.errors:
        for line in report.errors:
            print(f"edgeinfer: {line}", file=sys.stderr)
        return 1
    return 0


def _read_saved(path: Path) -> BenchReport:
    """A result saved with --json: a regular file of bounded size (a FIFO cannot hang the
    read), parsed with bounds, every field checked; BenchResultError names the file."""
    try:
        data = read_json_file(path, max_bytes=MAX_SAVED_BYTES, error=BenchResultError)
        return BenchReport.from_dict(data, what=str(path))
    except BenchResultError as exc:
        raise BenchResultError(f"--from {exc}") from None


def _measure(args: argparse.Namespace) -> BenchReport:
    if not args.models:
        raise InvalidRequestError("name at least one MODEL to benchmark (or --from FILE.json)")
    if args.reference is not None and not (args.agreement and args.reference.is_file()):
        raise InvalidRequestError(
            f"--reference {args.reference}: give an existing .gguf file, with --agreement"
        )
    settings = BenchSettings(
        models=tuple(args.models),
        prompt_tokens=int_list("-p/--prompt-tokens", args.prompt_tokens),
        new_tokens=args.new_tokens,
        repetitions=args.repetitions,
        warmup=args.warmup,
        threads=int_list("--threads", args.threads) if args.threads is not None else (),
        device=args.device,
        memory_budget=args.memory_budget,
        context_length=args.context_length,
        compare=args.compare,
        peer_models=tuple(args.peer_model),
        timeout_s=args.timeout,
        parallel=int_list("--parallel", args.parallel) if args.parallel is not None else (),
        engine=args.engine,
        speculative=args.speculative,
    )
    argv = sys.argv[1:]
    command = ["edgeinfer", *argv[argv.index("bench") :]] if "bench" in argv else []
    report = run_bench(settings, progress=ProgressLine(sys.stderr), command=command)
    if args.agreement and not report.interrupted:
        from ..bench.agreement import add_agreement

        print("measuring agreement with the reference ...", file=sys.stderr, flush=True)
        add_agreement(report, settings.models, args.reference, route=args.engine,
                      timeout_s=args.timeout)  # fmt: skip
    return report
