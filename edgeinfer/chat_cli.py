"""``edgeinfer chat``: an interactive conversation in the terminal.

The reply streams as it is generated. Ctrl-C stops the current reply (what was said stays in
the conversation) and returns to the prompt; Ctrl-D or /exit quits.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .cli import format_stats, load_model, sampling_kwargs

HELP = "commands: /reset (new conversation), /stats (last reply's figures), /exit"


class ChatSession:
    def __init__(self, model: Any, system: str | None, sampling: dict[str, Any]) -> None:
        self.model = model
        self.system = system
        self.sampling = sampling
        self.messages: list[dict[str, str]] = []
        self.last: Any = None
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last = None

    def reply(self, text: str) -> None:
        """Stream the model's answer to ``text``; Ctrl-C ends it early."""
        self.messages.append({"role": "user", "content": text})
        stream = self.model.chat(self.messages, stream=True, **self.sampling)
        parts: list[str] = []
        try:
            for chunk in stream:
                parts.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stream.close()
            sys.stdout.write(" [stopped]")
        finally:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        self.last = stream.result

    def stats_line(self) -> str:
        if self.last is None:
            return "no figures: the last reply was stopped, or there was none"
        return format_stats(self.last.stats, self.last.finish_reason)


def _read_line() -> str | None:
    """One line from the user; None at end of input. Ctrl-C at the prompt just re-prompts."""
    while True:
        try:
            return input(">>> " if sys.stdin.isatty() else "")
        except EOFError:
            return None
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit quits)", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> int:
    with load_model(args) as model:
        session = ChatSession(model, args.system, sampling_kwargs(args))
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
                print("(new conversation)", file=sys.stderr)
            elif command == "/stats":
                print(session.stats_line(), file=sys.stderr)
            elif command.startswith("/"):
                print(f"unknown command {command}; {HELP}", file=sys.stderr)
            else:
                session.reply(line)
    return 0
