"""``edgeinfer run MODEL -p PROMPT``: complete one prompt; the text alone goes to stdout."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..bounded_json import read_json_file
from ..errors import InvalidRequestError
from ..tools.spec import MAX_TOOLS_BYTES, check_tool_choice, check_tools
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


def add_parser(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="complete one prompt; the text alone goes to stdout",
        description="Complete PROMPT and stream the text to stdout.",
    )
    run.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    run.add_argument("-p", "--prompt", required=True, help="the prompt ('-' reads stdin)")
    run.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message through the model's chat template",
    )
    add_chat_template_flag(run)
    run.add_argument(
        "--tools",
        metavar="FILE.json",
        help="offer the functions in FILE (a JSON list of OpenAI tools) in a chat (implies "
        "--chat); a call the model makes is printed as JSON",
    )
    run.add_argument(
        "--tool-choice",
        default=None,
        help="auto (default), none, required, or a function's name to force",
    )
    run.add_argument("--stats", action="store_true", help="print timing figures on stderr")
    run.add_argument("--json", action="store_true", help="print one JSON object instead")
    add_sampling_flags(run)
    add_model_flags(run)


def cmd_run(args: argparse.Namespace) -> int:
    prompt = _stdin_prompt() if args.prompt == "-" else args.prompt
    kwargs = sampling_kwargs(args)
    tools = _tools(args)  # checked before the model loads
    with load_model(args) as model:
        if args.chat or tools:
            prepare_chat(model, args)
            message = {"role": "user", "content": prompt}
            stream = model.chat([message], stream=True, **tools, **kwargs)
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
            _write_json(args.model, model, result)
        else:
            _write_calls(result)
        if args.stats:
            print(format_stats(result.stats, result.finish_reason), file=sys.stderr)
    return 0


def _write_json(name: str, model: Any, result: Any) -> None:
    json.dump(
        {
            "model": name,
            "text": result.text,
            "token_ids": list(result.token_ids),
            "finish_reason": result.finish_reason,
            "tool_calls": list(result.tool_calls),
            "tool_call_error": result.tool_call_error,
            "stats": asdict(result.stats),
            "memory_plan": model.info.get("memory_plan"),
        },
        sys.stdout,
        ensure_ascii=False,
    )
    sys.stdout.write("\n")


def _tools(args: argparse.Namespace) -> dict[str, Any]:
    """``--tools FILE`` and ``--tool-choice`` as Model.chat's arguments, checked."""
    if args.tools is None:
        if args.tool_choice is not None:
            raise InvalidRequestError("--tool-choice needs --tools FILE.json")
        return {}
    value = read_json_file(Path(args.tools), max_bytes=MAX_TOOLS_BYTES, error=InvalidRequestError)
    if isinstance(value, dict) and "tools" in value:
        value = value["tools"]
    tools = check_tools(value)
    choice: Any = args.tool_choice
    if choice is not None and choice not in ("auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    check_tool_choice(choice, tools)
    return {"tools": value, "tool_choice": choice}


def _write_calls(result: Any) -> None:
    """The text ends with a newline; each call follows as one line of JSON."""
    if not result.text.endswith("\n"):
        sys.stdout.write("\n")  # the output ends with a newline, as a line of text
    for call in result.tool_calls:
        sys.stdout.write(json.dumps(call, ensure_ascii=False) + "\n")
    if result.tool_call_error:
        print(
            f"edgeinfer: the reply's tool call is invalid: {result.tool_call_error}",
            file=sys.stderr,
        )


def _stdin_prompt() -> str:
    """stdin's text without the one final newline that `echo` and editors add: the
    prompt a user typed does not end with it, and a trailing newline changes the answer."""
    text = sys.stdin.read()
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text
