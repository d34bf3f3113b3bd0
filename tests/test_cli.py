"""The edgeinfer command, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import edgeinfer

from .leakcheck import KillAtEnd
from .signals import sigint_default

CLI = [sys.executable, "-m", "edgeinfer.cli"]


def run(*args: str, stdin: str | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def test_help_answers() -> None:
    out = run("--help")
    assert out.returncode == 0
    for command in ("run", "chat", "models"):
        assert command in out.stdout
    run_help = run("run", "--help").stdout
    for flag in (
        "--prompt",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--stats",
        "--json",
        "--max-new-tokens",
    ):
        assert flag in run_help


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "/no/such/model.gguf", "-p", "hi"), "no such file"),
        (("models", "path", "nope"), "not in the catalog"),
    ],
)
def test_errors_are_one_line_without_traceback(args: tuple[str, ...], message: str) -> None:
    out = run(*args)
    assert out.returncode == 1
    assert out.stdout == ""
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_bad_sampling_value_is_an_error_line(default_gguf: Path) -> None:
    out = run("run", str(default_gguf), "-p", "hi", "--top-p", "7")
    assert out.returncode == 1 and "top_p" in out.stderr and "Traceback" not in out.stderr


def test_models_list_shows_the_default() -> None:
    out = run("models", "list")
    assert out.returncode == 0 and "smollm2-135m-instruct" in out.stdout


@pytest.mark.model
def test_models_path_prints_the_cached_file(default_gguf: Path) -> None:
    out = run("models", "path", "smollm2-135m-instruct")
    assert out.returncode == 0 and out.stdout.strip() == str(default_gguf)


@pytest.mark.model
def test_run_prints_only_the_generated_text(default_gguf: Path) -> None:
    out = run(
        "run",
        "smollm2-135m-instruct",
        "-p",
        "The capital of France is",
        "-n",
        "16",
        "--temperature",
        "0",
        "--context-length",
        "1024",
    )
    assert out.returncode == 0, out.stderr
    with edgeinfer.load("smollm2-135m-instruct", context_length=1024) as model:  # the same
        expected = model.generate("The capital of France is", max_new_tokens=16, temperature=0)
    assert out.stdout.rstrip("\n") == expected.text.rstrip("\n")  # only the text, no prompt
    assert out.stderr == ""


@pytest.mark.model
def test_run_json_and_stats(default_gguf: Path) -> None:
    out = run(
        "run",
        "smollm2-135m-instruct",
        "-p",
        "The capital of France is",
        "-n",
        "8",
        "--temperature",
        "0",
        "--json",
        "--stats",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["text"] and data["finish_reason"] in ("stop", "length")
    assert data["stats"]["completion_tokens"] == len(data["token_ids"])
    assert "decode" in out.stderr and "tok/s" in out.stderr


@pytest.mark.model
def test_chat_keeps_the_conversation_and_answers_commands(default_gguf: Path) -> None:
    script = "Hello!\n/stats\nWhat did I just say?\n/reset\n/bogus\n/exit\n"
    out = run("chat", "--temperature", "0", "-n", "24", stdin=script)
    assert out.returncode == 0, out.stderr
    assert "reused" in out.stderr  # /stats
    assert "(new conversation)" in out.stderr and "unknown command /bogus" in out.stderr
    assert len([line for line in out.stdout.splitlines() if line.strip()]) >= 2


@pytest.mark.model
def test_ctrl_c_stops_the_reply_and_returns_to_the_prompt(
    default_gguf: Path, kill_at_end: KillAtEnd
) -> None:
    proc = kill_at_end(subprocess.Popen(
        [
            *CLI,
            "chat",
            "--temperature",
            "0.8",
            "--seed",
            "1",
            # long enough that the first reply is still streaming when Ctrl-C comes, short
            # enough that the second reply ends in time on a slow or busy machine
            "-n",
            "400",
            "--context-length",
            "4096",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=sigint_default,
    ))  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("Write a very long story about a dragon.\n")
    proc.stdin.flush()
    proc.stdout.read(1)  # the reply has started streaming
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.stdin.write("/stats\nSay hi.\n/exit\n")
    proc.stdin.flush()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "[stopped]" in stdout
    assert "Traceback" not in stderr
    assert "stopped after" in stderr and "tok/s (figures of the part generated)" in stderr


@pytest.mark.parametrize(
    "argv, verbose, debug",
    [
        (["run", "m", "-p", "x"], False, False),
        (["-v", "run", "m", "-p", "x"], True, False),
        (["run", "m", "-p", "x", "-v"], True, False),
        (["--debug", "run", "m", "-p", "x"], False, True),
        (["run", "m", "-p", "x", "--debug"], False, True),
        (["-v", "devices", "--debug"], True, True),
    ],
)
def test_log_flags_work_before_and_after_the_subcommand(
    argv: list[str], verbose: bool, debug: bool
) -> None:
    from edgeinfer.cli.main import build_parser

    args = build_parser().parse_args(argv)
    assert (args.verbose, args.debug) == (verbose, debug)


def test_log_flag_after_the_subcommand_runs_for_real() -> None:
    out = run("models", "list", "-v")
    assert out.returncode == 0, out.stderr


def test_a_prompt_from_stdin_loses_one_final_newline(tiny_llama_gguf: Path) -> None:
    prompt = "one two three"
    common = ("run", str(tiny_llama_gguf), "-n", "8", "--temperature", "0", "--json")
    typed = run(*common, "-p", prompt)
    piped = run(*common, "-p", "-", stdin=prompt + "\n")
    kept = run(*common, "-p", "-", stdin=prompt + "\n\n")  # only one newline goes
    assert typed.returncode == piped.returncode == kept.returncode == 0, piped.stderr
    typed, piped, kept = (json.loads(out.stdout)["stats"] for out in (typed, piped, kept))
    assert piped["prompt_tokens"] == typed["prompt_tokens"]
    assert kept["prompt_tokens"] > typed["prompt_tokens"]
