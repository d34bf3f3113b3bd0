"""``edgeinfer chat``: an interactive conversation in the terminal.

The reply streams as it is generated. Ctrl-C stops the current reply (what was said stays in
the conversation) and returns to the prompt; Ctrl-D or /exit quits.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..files import catalog
from .chat_session import SessionFiles
from .common import (
    MODEL_HELP,
    add_chat_template_flag,
    add_model_flags,
    add_sampling_flags,
    format_stats,
    load_model,
    prepare_chat,
    sampling_kwargs,
)

HELP = "commands: /reset (new conversation), /stats (last reply's figures), /exit"


def add_parser(sub: Any) -> None:
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
        help=f"{MODEL_HELP} (default: {catalog.DEFAULT_MODEL})",
    )
    chat.add_argument("--system", metavar="TEXT", help="system message for the conversation")
    chat.add_argument(
        "--session",
        metavar="NAME",
        help="keep the conversation (messages and the model's KV) under $EDGEINFER_HOME/"
        "sessions/NAME and resume it next time: only the new turn is read",
    )
    add_chat_template_flag(chat)
    add_sampling_flags(chat)
    add_model_flags(chat)


class ChatSession:
    def __init__(self, model: Any, system: str | None, sampling: dict[str, Any]) -> None:
        self.model = model
        self.system = system
        self.sampling = sampling
        self.messages: list[dict[str, str]] = []
        self.last: Any = None
        self.partial: str | None = None  # the figures of a stopped reply
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last = None

    def reply(self, text: str) -> None:
        """Stream the model's answer to ``text``; Ctrl-C ends it early."""
        self.messages.append({"role": "user", "content": text})
        stream = self.model.chat(self.messages, stream=True, **self.sampling)
        parts: list[str] = []
        self.partial = None
        start = time.perf_counter()
        stamps: list[float] = []
        n = 0
        try:
            with _no_echo():  # keys typed during the reply do not land inside it
                for chunk in stream:
                    parts.append(chunk.text)
                    n += len(chunk.token_ids)
                    stamps.append(time.perf_counter())
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            stream.close()
            sys.stdout.write(" [stopped]")
            ttft = (stamps[0] - start) * 1000 if stamps else 0.0
            rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
            self.partial = (
                f"stopped after {n} tok: ttft {ttft:.0f} ms, decode {rate:.1f} tok/s "
                "(figures of the part generated)"
            )
        finally:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        self.last = stream.result

    def stats_line(self) -> str:
        if self.last is None:
            return self.partial or "no figures yet: there was no reply"
        return format_stats(self.last.stats, self.last.finish_reason)


@contextmanager
def _no_echo() -> Iterator[None]:
    """Terminal echo off while a reply streams, and what was typed meanwhile discarded."""
    if not sys.stdin.isatty():
        yield
        return
    try:
        import termios
    except ImportError:  # Windows
        yield
        return
    fd = sys.stdin.fileno()
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _read_line() -> str | None:
    """One line from the user; None at end of input. Ctrl-C at the prompt just re-prompts."""
    while True:
        try:
            return input(">>> " if sys.stdin.isatty() else "")
        except EOFError:
            if sys.stdin.isatty():
                print()  # Ctrl-D: the shell's prompt starts on a line of its own
            return None
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit quits)", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> int:
    files = SessionFiles(args.session) if args.session is not None else None
    saved = files.read_messages() if files is not None else None
    with load_model(args) as model:
        prepare_chat(model, args)
        session = ChatSession(model, args.system, sampling_kwargs(args))
        if files is not None and saved is not None:
            session.messages = saved
            files.restore(model)
            print(f"(resumed session {args.session}: {len(saved)} messages)", file=sys.stderr)
        if sys.stdin.isatty():
            print(f"chatting with {args.model}; {HELP}", file=sys.stderr)
        while (line := _read_line()) is not None:
            command = line.strip()
            if not command:
                continue
            if command == "/exit":
                break
            if command == "/reset":
                session.reset()
                if files is not None:
                    files.clear()
                print("(new conversation)", file=sys.stderr)
            elif command == "/stats":
                print(session.stats_line(), file=sys.stderr)
            elif command.startswith("/"):
                print(f"unknown command {command}; {HELP}", file=sys.stderr)
            else:
                session.reply(line)
                if files is not None:
                    files.save(model, session.messages)
    return 0
