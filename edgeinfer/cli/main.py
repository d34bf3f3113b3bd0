"""The ``edgeinfer`` parser and dispatch: each command's flags and work live in its own
module; this one only puts them together."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from .. import __version__
from . import batch, bench, chat, convert, devices, embed, models, run, serve
from .common import configure_logging, run_command

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run.cmd_run,
    "chat": chat.cmd_chat,
    "models": models.cmd_models,
    "convert": convert.cmd_convert,
    "devices": devices.cmd_devices,
    "bench": bench.cmd_bench,
    "serve": serve.cmd_serve,
    "batch": batch.cmd_batch,
    "embed": embed.cmd_embed,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeinfer",
        description="Run language models on this machine, offline.",
        epilog="Models live in $EDGEINFER_HOME (default ~/.cache/edgeinfer).",
    )
    parser.add_argument("--version", action="version", version=f"edgeinfer {__version__}")
    _add_log_flags(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # the order of `edgeinfer --help`
    for command in (run, chat, batch, embed, convert, devices, bench, serve, models):
        command.add_parser(sub)
    for subparser in _subparsers(parser):
        # after the subcommand too (`edgeinfer run ... -v`); SUPPRESS keeps a flag given
        # before the subcommand from being reset by the subparser's default
        _add_log_flags(subparser, default=argparse.SUPPRESS)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand's parser, nested ones (`models list`) included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += [child, *_subparsers(child)]
    return found


def _add_log_flags(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--debug", action="store_true", default=default, help="log everything, tracebacks"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default, help="log what edgeinfer does"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    return run_command(COMMANDS[args.command], args)
