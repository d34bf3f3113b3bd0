"""Tool calls under tool_choice="auto": does the model call when it should, the right
function, with arguments valid under the schema and right, not call when no tool fits, and
answer in text after the tool's result?

64 tasks, defined in tool_tasks.py (no network): one call, several calls, calls with nested
arguments (objects and lists of objects), and tasks where no offered tool fits. Each task
offers one of three toolboxes (4 functions each, JSON schemas). For a task that calls, each
call gets a made-up result and the model answers again; that final answer must be text with
no tool markup, no call and no call written as JSON. A task where no tool fits passes "no
call" when the reply holds no call, and "answered in text" when it is also no call written
as JSON (the Coder models write calls to made-up functions in a ```json fence).

Settings of ``tool_choice="auto"`` (edgeinfer.tools.run.tool_chat):

- ``auto``: plain, calls parsed and checked afterwards;
- ``auto+grammar``: a call the model opens is held to a function and its schema;
- ``auto+retry``: one retry (edgeinfer/tools/retry.py): a failed call or a call written
  outside the template's format is asked again with the call forced, a repeat of the call
  just answered is asked again with tool_choice "none";
- ``auto+grammar+retry``: both (``--settings`` to run it; not in the default run).

Greedy (temperature 0), bounded replies; models through llama.cpp on their catalog GGUF.

    python benchmarks/tool_calls.py --threads 2 -o benchmarks/results/tool_calls.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions
from tool_tasks import BOXES, TASKS, Task, fake_result, matches

MODELS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
SETTINGS = {
    "auto": {"auto": "plain", "retry": False},
    "auto+grammar": {"auto": "grammar", "retry": False},
    "auto+retry": {"auto": "plain", "retry": True},
    "auto+grammar+retry": {"auto": "grammar", "retry": True},
}
MARKUP = ("<tool_call>", "</tool_call>", "<tool_response", "</tool_response>")
DEFAULT_SETTINGS = ("auto", "auto+grammar", "auto+retry")
FIRST_TOKENS, FINAL_TOKENS = 96, 64


def _reply(model: Any, messages: list[dict[str, Any]], tools: list[Any], setting: str, n: int):
    from edgeinfer.tools.run import tool_chat

    stream = tool_chat(model, messages, tools=tools, tool_choice="auto", stream=True,
                       temperature=0, max_new_tokens=n, **SETTINGS[setting])  # fmt: skip
    result = stream.collect()
    return result, {"retried": stream.retried, "cut_at": stream.cut_at}


_CALL_JSON = re.compile(r'"name"\s*:\s*"[^"]*"\s*,\s*"(?:arguments|parameters)"\s*:')


def _outside_call(text: str) -> bool:
    """The text holds a call written as JSON outside the format (naming any function)."""
    return bool(_CALL_JSON.search(text))


def run_task(model: Any, task: Task, setting: str) -> dict[str, Any]:
    """One task under one setting: the first reply, and the final answer after results."""
    tools = BOXES[task.box]
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.user}]
    t0 = time.perf_counter()
    first, how = _reply(model, messages, tools, setting, FIRST_TOKENS)
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first.tool_calls
    ]
    row: dict[str, Any] = {
        "id": task.id, "kind": task.kind, "setting": setting,
        "calls": [{"name": n, "arguments": a} for n, a in calls],
        "text": first.text, "finish_reason": first.finish_reason,
        "tool_call_error": first.tool_call_error, "retried": how["retried"],
        "outside_call": _outside_call(first.text),
        "tokens": first.stats.completion_tokens,
    }  # fmt: skip
    row["right_function"], row["arguments_right"] = matches(task, calls)
    if calls and row["right_function"]:
        messages.append(
            {"role": "assistant", "content": None, "tool_calls": list(first.tool_calls)}
        )
        for call, (name, arguments) in zip(first.tool_calls, calls, strict=True):
            result = fake_result(name, arguments)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        final, fhow = _reply(model, messages, tools, setting, FINAL_TOKENS)
        row["final"] = {
            "text": final.text, "calls": len(final.tool_calls), "retried": fhow["retried"],
            "cut_at": fhow["cut_at"], "finish_reason": final.finish_reason,
            "markup_free": not any(m in final.text for m in MARKUP),
            "outside_call": _outside_call(final.text),
            "tokens": final.stats.completion_tokens,
        }  # fmt: skip
        f = row["final"]
        f["clean"] = bool(
            f["markup_free"] and not f["calls"] and not f["outside_call"] and final.text.strip()
        )
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def _rate(rows: list[dict[str, Any]], test: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    hits = sum(1 for r in rows if test(r))
    return {"rate": hits / len(rows) if rows else None, "of": len(rows), "hits": hits}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The pass rates of one model under one setting."""
    should = [r for r in rows if r["kind"] != "none"]
    attempted = [r for r in should if r["calls"] or r["tool_call_error"] or r["outside_call"]]
    finals = [r for r in should if "final" in r]
    none = [r for r in rows if r["kind"] == "none"]
    return {
        "called_when_should": _rate(should, lambda r: bool(r["calls"])),
        "right_function": _rate(should, lambda r: r["right_function"]),
        "arguments_valid": _rate(
            attempted, lambda r: bool(r["calls"]) and not r["tool_call_error"]
        ),
        "arguments_right": _rate(should, lambda r: r["arguments_right"]),
        "no_call_when_none_fits": _rate(none, lambda r: not r["calls"]),
        "answered_in_text_when_none_fits": _rate(
            none, lambda r: not r["calls"] and not r["outside_call"] and r["text"].strip()
        ),
        "final_answer_clean": _rate(finals, lambda r: r["final"]["clean"]),
        "final_answer_markup_free": _rate(finals, lambda r: r["final"]["markup_free"]),
        "by_kind": {
            kind: _rate([r for r in should if r["kind"] == kind], lambda r: r["arguments_right"])
            for kind in ("single", "multi", "nested")
        },
        "retries": sum(1 for r in rows if r["retried"])
        + sum(1 for r in finals if r["final"]["retried"]),
        "cut_at_result_marker": sum(1 for r in finals if r["final"]["cut_at"]),
        "seconds": round(sum(r["seconds"] for r in rows), 1),
    }  # fmt: skip


def run_model(name: str, threads: int, settings: list[str]) -> dict[str, list[dict[str, Any]]]:
    import edgeinfer

    model = edgeinfer.load(name, engine="llama.cpp", threads=threads, context_length=4096)
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    try:
        for i, task in enumerate(sorted(TASKS, key=lambda t: t.box)):  # a box's prompt reused
            for setting in settings:
                rows[setting].append(run_task(model, task, setting))
            print(f"{name}: {i + 1}/{len(TASKS)} {task.id}", file=sys.stderr, flush=True)
    finally:
        model.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS))
    p.add_argument("-o", "--out", type=Path, default=Path("benchmarks/results/tool_calls.json"))
    args = p.parse_args()
    settings = args.settings.split(",")
    run = conditions.start(args.threads, 1)
    per_task: dict[str, Any] = {}
    for name in args.models.split(","):
        per_task[name] = run_model(name, args.threads, settings)
        write(args.out, run, settings, per_task)  # each model's rows kept as it ends
    print(json.dumps(json.loads(args.out.read_text())["summary"], indent=1))


def write(out: Path, run: dict[str, Any], settings: list[str], per_task: dict[str, Any]) -> None:
    summary = {m: {s: summarize(rows) for s, rows in by.items()} for m, by in per_task.items()}
    kinds = {k: sum(1 for t in TASKS if t.kind == k) for k in ("single", "multi", "nested", "none")}
    result = {
        "conditions": conditions.finish(dict(run)),
        "settings": {s: SETTINGS[s] for s in settings},
        "tasks": {"total": len(TASKS), **kinds},
        "max_new_tokens": {"first": FIRST_TOKENS, "final": FINAL_TOKENS},
        "temperature": 0,
        "summary": summary,
        "per_task": per_task,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
