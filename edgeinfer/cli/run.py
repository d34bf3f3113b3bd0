"""``edgeinfer run MODEL -p PROMPT``: complete one prompt; the text alone goes to stdout."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

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
    run.add_argument("--stats", action="store_true", help="print timing figures on stderr")
    run.add_argument("--json", action="store_true", help="print one JSON object instead")
    add_sampling_flags(run)
    add_model_flags(run)


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
            _write_json(args.model, model, result)
        elif not result.text.endswith("\n"):
            sys.stdout.write("\n")  # the output ends with a newline, as a line of text
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
            "stats": asdict(result.stats),
            "memory_plan": model.info.get("memory_plan"),
        },
        sys.stdout,
        ensure_ascii=False,
    )
    sys.stdout.write("\n")
