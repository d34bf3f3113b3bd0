"""``edgeinfer batch MODEL IN.jsonl -o OUT.jsonl``: a file of requests through one model (or a
Ray cluster), one record per row appended to OUT in input order; running it again resumes."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from .common import (
    MODEL_HELP,
    add_chat_template_flag,
    add_model_flags,
    add_sampling_flags,
    load_options,
    parse_parallel,
    sampling_kwargs,
)

__all__ = ["add_parser", "cmd_batch"]

_ROWS = (
    "Each line of IN is one JSON object: id (text or integer; default: the line number), "
    "prompt (text) or messages (a chat), and any of max_tokens, temperature, top_p, top_k, "
    "min_p, repetition_penalty, seed, stop, logit_bias, response_format (as the server takes "
    "them; the flags below are the defaults). A .csv file with a header line works too. Each "
    "line of OUT is {id, text, finish_reason, usage, parsed, error}; a bad row gets an error "
    'record and the job goes on (a CSV id is its text: 007 stays "007"). Ctrl-C finishes '
    "the rows in flight (twice: abandons them); the same command then resumes, skipping the "
    "ids already in OUT. One job at a time writes OUT: a second one is refused."
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "batch",
        help="run a file of requests (JSON Lines) and write one record per row, resumable",
        description=f"Run every request in IN through MODEL and append the records to OUT, "
        f"in input order. {_ROWS}",
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("input", metavar="IN", help="requests: a .jsonl (or .csv) file")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="records (.jsonl)")
    p.add_argument(
        "--parallel",
        default="1",
        metavar="N|auto",
        help="sequence slots: N requests generated together in one forward pass per step "
        "('auto': as many as the memory budget holds; default: 1)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run on Ray (needs edgeinfer[ray]): alone, a local Ray or $RAY_ADDRESS; with "
        "ADDRESS (--ray=ray://head:10001 or auto), that cluster. Every worker loads MODEL: "
        "a catalog name from its own cache, or a path all workers see",
    )
    p.add_argument(
        "--ray-actors",
        type=int,
        default=1,
        metavar="N",
        help="Ray actors, each holding one model with --parallel slots (default: 1)",
    )
    p.add_argument("--no-progress", action="store_true", help="draw no progress line")
    add_chat_template_flag(p)
    add_sampling_flags(p)
    add_model_flags(p)


def cmd_batch(args: argparse.Namespace) -> int:
    parallel = parse_parallel(args.parallel)
    if args.ray_actors < 1:
        raise InvalidRequestError(f"--ray-actors {args.ray_actors} must be 1 or more")
    sampling = sampling_kwargs(args)
    options = load_options(args, parallel)
    template = _template(args)
    _check_files(args)  # before the model takes seconds to load
    try:
        summary = _run(args, options, template, sampling)
    except KeyboardInterrupt:
        # the job left its output resumable; the process is on its way out, and a late
        # Ctrl-C (a second press after the rows in flight ended) must not cut the exit short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise
    _report(summary)
    return 0


def _run(
    args: argparse.Namespace,
    options: dict[str, Any],
    template: str | None,
    sampling: dict[str, Any],
) -> Any:
    if args.ray is not None:
        from ..batch.ray_job import run_ray_batch

        return run_ray_batch(
            args.model,
            args.input,
            args.output,
            address=args.ray or None,
            actors=args.ray_actors,
            load_options=options,
            chat_template=template,
            progress=not args.no_progress,
            **sampling,
        )
    return _run_here(args, options, template, sampling)


def _template(args: argparse.Namespace) -> str | None:
    if not args.chat_template:
        return None
    from ..chat import resolve_chat_template

    return resolve_chat_template(args.chat_template)


def _check_files(args: argparse.Namespace) -> None:
    from ..batch.job import check_paths
    from ..batch.output import check_free

    check_free(check_paths(Path(args.input), args.output))


def _run_here(
    args: argparse.Namespace,
    options: dict[str, Any],
    template: str | None,
    sampling: dict[str, Any],
) -> Any:
    from ..batch import run_batch
    from ..loader import load

    with load(args.model, **options) as model:
        if template is not None:
            model.use_chat_template(template)
        return run_batch(model, args.input, args.output, progress=not args.no_progress, **sampling)


def _report(summary: Any) -> None:
    seconds = max(summary.seconds, 1e-9)
    errors = f" ({summary.errors} errors)" if summary.errors else ""
    skipped = f", {summary.skipped} rows were there already" if summary.skipped else ""
    print(
        f"edgeinfer: {summary.written} records written to {summary.output}{errors}{skipped}, "
        f"in {summary.seconds:.1f} s ({summary.written / seconds:.1f} rows/s, "
        f"{summary.completion_tokens / seconds:.0f} tok/s)",
        file=sys.stderr,
    )
