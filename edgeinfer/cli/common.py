"""What the commands share: the model, sampling and chat-template flags, loading the model the
flags name, the figures line, and how logs and errors reach the terminal."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import KV_DTYPES as LOAD_KV_DTYPES
from ..config import MAX_PARALLEL
from ..errors import EdgeInferError, InvalidRequestError, short_repr

logger = logging.getLogger(__name__)

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
_MAX_SCHEMA_BYTES = 1 << 20  # a --json-schema file; the structured-output bounds apply after
MODEL_HELP = "catalog name, .gguf file or model folder"


def add_model_flags(p: argparse.ArgumentParser) -> None:
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
        "--kv-dtype",
        choices=LOAD_KV_DTYPES,
        default="auto",
        help="the KV cache's element type: auto (default: the model's own; float32 on an ONNX "
        "transcode, float16 on llama.cpp), or float16 for half the cache's memory (a catalog "
        "model's transcode is built again for it; 'edgeinfer bench --agreement' measures it)",
    )
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


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
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
    g.add_argument(
        "--frequency-penalty",
        type=float,
        metavar="F",
        help="OpenAI's: minus F per time a token was generated, -2 to 2 (default: 0)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        metavar="P",
        help="OpenAI's: minus P once a token was generated, -2 to 2 (default: 0)",
    )
    g.add_argument("--seed", type=int, metavar="S", help="same seed, same output")
    g.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop before this text (repeatable)"
    )
    g.add_argument(
        "--speculative",
        metavar="MODE",
        help="speculative decoding: off, auto (prompt lookup while it pays), lookup or "
        "lookup:N (draft up to N tokens from the prompt and the reply so far), or "
        "draft:MODEL[:N] (a smaller model of the same vocabulary drafts); the tokens are "
        "the same, only faster (default: off)",
    )
    _add_structured_flags(p)


def _add_structured_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("structured output (needs edgeinfer[structured])")
    x = s.add_mutually_exclusive_group()
    x.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer with JSON that validates against the JSON schema in FILE",
    )
    x.add_argument("--regex", metavar="PATTERN", help="answer with text matching PATTERN")
    x.add_argument("--choice", metavar="A,B,C", help="answer with exactly one of these")


def add_chat_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        help="chat format for a model that has none: chatml, llama3, gemma, or a Jinja file "
        "(default: the model's own)",
    )


def prepare_chat(model: Any, args: argparse.Namespace) -> None:
    """Set --chat-template, or refuse a model without a template before anything is asked."""
    from ..chat import BUILTIN_TEMPLATES, resolve_chat_template

    if args.chat_template:
        model.use_chat_template(resolve_chat_template(args.chat_template))
    elif model.chat_template is None:
        raise InvalidRequestError(
            f"{args.model} has no chat template; pass --chat-template with one of "
            f"{', '.join(BUILTIN_TEMPLATES)} or a Jinja file, or complete plain text with "
            f"'edgeinfer run {args.model} -p TEXT'"
        )


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "seed",
        "stop",
        "speculative",
    )
    kwargs = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    response_format = _response_format(args)
    if response_format is not None:
        kwargs["response_format"] = response_format
    return kwargs


def _response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    if getattr(args, "json_schema", None):
        from ..bounded_json import read_json_file

        path = Path(args.json_schema)
        schema = read_json_file(path, max_bytes=_MAX_SCHEMA_BYTES, error=InvalidRequestError)
        return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}
    if getattr(args, "regex", None):
        return {"type": "regex", "pattern": args.regex}
    if getattr(args, "choice", None):
        choices = [c for c in args.choice.split(",") if c]
        return {"type": "choice", "choices": choices}
    return None


def load_options(args: argparse.Namespace, parallel: int | str = 1) -> dict[str, Any]:
    """``load()``'s keywords from the model flags (add_model_flags); ``parallel`` only when
    it is not 1, so at 1 every command loads a model the same way."""
    options: dict[str, Any] = {
        "device": args.device,
        "allow_fallback": args.allow_fallback,
        "memory_budget": args.memory_budget,
        "context_overflow": args.context_overflow,
        "context_length": args.context_length,
        "threads": args.threads,
    }
    if getattr(args, "kv_dtype", "auto") != "auto":
        options["kv_dtype"] = args.kv_dtype
    if parallel != 1:
        options["parallel"] = parallel
    if getattr(args, "prompt_cache", None):  # serve --prompt-cache DIR
        options["prompt_cache"] = args.prompt_cache
    if getattr(args, "speculative", None):  # the model's default (run/chat: also per request)
        options["speculative"] = args.speculative
    return options


def load_model(args: argparse.Namespace, parallel: int | str = 1) -> Any:
    """The model the model flags (add_model_flags) name, with ``parallel`` sequence slots."""
    from ..loader import load

    return load(args.model, **load_options(args, parallel))


def parse_parallel(value: str | int) -> int | str:
    """--parallel as ``load`` takes it: an integer from 1 to 256, or "auto"."""
    text = str(value).strip()
    if text.lower() == "auto":
        return "auto"
    if text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_PARALLEL:
        return int(text)
    raise InvalidRequestError(
        f"--parallel {short_repr(text, 40)} is invalid: give a number of sequence slots from 1 to "
        f"{MAX_PARALLEL}, or auto"
    )


def format_stats(stats: Any, finish_reason: str) -> str:
    drafted = getattr(stats, "draft_tokens", 0)
    speculated = f", drafted {drafted} tok (kept {stats.accepted_tokens})" if drafted else ""
    return (
        f"prompt {stats.prompt_tokens} tok (reused {stats.reused_prompt_tokens}), "
        f"completion {stats.completion_tokens} tok, ttft {stats.ttft_s * 1000:.0f} ms, "
        f"prefill {stats.prefill_tokens_per_s:.0f} tok/s, "
        f"decode {stats.decode_tokens_per_s:.1f} tok/s{speculated}, finish {finish_reason}"
    )


class _Speaker(logging.Formatter):
    """Each line says who said it: the engines' own log lines are not edgeinfer's."""

    def format(self, record: logging.LogRecord) -> str:
        who = "llama.cpp" if record.name.endswith("llama_cpp.engine") else "edgeinfer"
        return f"{who}: {record.getMessage()}"


def configure_logging(args: argparse.Namespace) -> None:
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Speaker())
    logging.basicConfig(level=level, handlers=[handler])
    if not args.debug:  # the engine's own log is only for --debug
        logging.getLogger("edgeinfer.runtimes.llama_cpp.engine").setLevel(logging.WARNING)


class _CtrlC:
    """Ctrl-C as Python's own handler raises it, remembering that it came: native code
    (numpy's ``tofile``, for one) can turn the KeyboardInterrupt raised inside it into
    another exception, which is still the user's Ctrl-C."""

    WINDOW_S = 10.0  # an exception this soon after a Ctrl-C is taken as its unwinding

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.at = time.monotonic()
        raise KeyboardInterrupt

    @property
    def seen(self) -> bool:
        """A Ctrl-C came just now (not one that a command handled minutes ago, as chat's
        stop-the-reply does)."""
        return self.at is not None and time.monotonic() - self.at < self.WINDOW_S


def _watch_ctrl_c() -> _CtrlC | None:
    """Install the remembering handler where Python's default one is (not where SIGINT is
    ignored, as in a background job, and not outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    watcher = _CtrlC()
    signal.signal(signal.SIGINT, watcher)
    return watcher


def run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command: every EdgeInferError becomes one line on stderr and exit status 1
    (a traceback with --debug), Ctrl-C exit status 130."""
    ctrl_c = _watch_ctrl_c()
    try:
        return _run(command, args, ctrl_c)
    finally:
        if ctrl_c is not None and signal.getsignal(signal.SIGINT) is ctrl_c:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(
    command: Callable[[argparse.Namespace], int], args: argparse.Namespace, ctrl_c: _CtrlC | None
) -> int:
    try:
        return command(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except EdgeInferError as exc:
        if _unwinding(ctrl_c, args):
            return EXIT_INTERRUPTED
        if args.debug:
            raise
        print(f"edgeinfer: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # stdout closed early (| head): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit-time flush does not fail again
        return 0
    except Exception:
        if _unwinding(ctrl_c, args):
            return EXIT_INTERRUPTED
        raise


def _unwinding(ctrl_c: _CtrlC | None, args: argparse.Namespace) -> bool:
    """Whether the exception being handled is a Ctrl-C that native code turned into another
    (never with --debug, which shows every traceback); its traceback goes to the debug log."""
    if ctrl_c is None or not ctrl_c.seen or args.debug:
        return False
    logger.debug("interrupted", exc_info=True)
    print(file=sys.stderr)
    return True
