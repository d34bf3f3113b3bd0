"""The CLI's rough edges, each pinned: python -m, newline-terminated output, a header on
models list, chat templates for models without one, partial figures after a stopped reply."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .leakcheck import KillAtEnd

CLI = [sys.executable, "-m", "edgeinfer.cli"]


def _run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, input=stdin, timeout=300)


def test_python_dash_m_edgeinfer_is_the_command() -> None:
    done = _run(sys.executable, "-m", "edgeinfer", "--version")
    assert done.returncode == 0 and done.stdout.startswith("edgeinfer ")
    assert _run(sys.executable, "-m", "edgeinfer", "models", "list").returncode == 0


def test_models_list_has_a_header_row() -> None:
    lines = _run(*CLI, "models", "list").stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "KIND", "SIZE", "STATUS"]
    assert any(line.startswith("smollm2-135m-instruct") for line in lines[1:])


def test_run_ends_its_output_with_a_newline(tiny_llama_gguf: Path) -> None:
    done = _run(*CLI, "run", str(tiny_llama_gguf), "-p", "Hi", "-n", "5", "--threads", "1",
                "--context-length", "128", "--temperature", "0")  # fmt: skip
    assert done.returncode == 0 and done.stdout.endswith("\n")


def test_chat_without_a_template_is_refused_before_prompting(no_template_model: Path) -> None:
    done = _run(*CLI, "chat", str(no_template_model), "--threads", "1", stdin="hello\n")
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "has no chat template; pass --chat-template" in line and "chatml" in line
    assert "generate()" not in line  # not the Python API
    done = _run(*CLI, "run", str(no_template_model), "-p", "hi", "--chat", "--threads", "1")
    assert done.returncode == 1 and "--chat-template" in done.stderr


@pytest.mark.parametrize("template", ["chatml", "llama3", "gemma", "file"])
def test_chat_template_flag(no_template_model: Path, tmp_path: Path, template: str) -> None:
    name = template
    if template == "file":
        path = tmp_path / "t.jinja"
        path.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
        name = str(path)
    argv = [*CLI, "run", str(no_template_model), "-p", "hi", "--chat", "--chat-template", name]
    done = _run(*argv, "-n", "3", "--threads", "1", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    bad = _run(*CLI, "run", str(no_template_model), "-p", "hi", "--chat",
               "--chat-template", "nonesuch")  # fmt: skip
    assert bad.returncode == 1 and "neither a built-in template" in bad.stderr


@pytest.mark.model
def test_devices_plans_what_run_gets(default_gguf: Path) -> None:
    done = _run(*CLI, "devices", str(default_gguf), "--memory-budget", "300MB", "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)["memory_plan"]
    ran = _run(*CLI, "run", str(default_gguf), "-p", "Hi", "-n", "2", "--memory-budget", "300MB",
               "--json")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)["memory_plan"]
    assert shown["context_length"] == got["context_length"]
    assert shown["batch_size"] == got["batch_size"]


def test_a_refusal_adds_up(tiny_llama_gguf: Path) -> None:
    import re

    from edgeinfer.errors import MemoryBudgetError
    from edgeinfer.loader import resolve
    from edgeinfer.memory.plan import plan_memory
    from edgeinfer.memory.shape import shape_of

    with pytest.raises(MemoryBudgetError) as info:
        plan_memory(shape_of(resolve(tiny_llama_gguf)), budget="20MB", context_length=256)
    text = str(info.value)
    needed = int(re.search(r"needs (\d+) MB", text).group(1))
    parts = text.split(": ", 1)[1].split(";")[0]
    figures = [int(x) for x in re.findall(r"(\d+) MB", parts)]
    assert "headroom" in parts
    assert abs(sum(figures) - needed) <= len(figures)  # each part rounded to a whole MB


@pytest.mark.model
def test_the_quantizers_reason_reaches_the_user(default_gguf: Path, tmp_path: Path) -> None:
    done = _run(*CLI, "convert", str(default_gguf), "-o", str(tmp_path / "x.gguf"),
                "--quant", "q4_k_m")  # fmt: skip
    assert done.returncode == 1
    assert "llama.cpp said:" in done.stderr and "requantizing" in done.stderr
    assert "Traceback" not in done.stderr


def test_devices_says_each_thing_once() -> None:
    out = _run(*CLI, "devices").stdout
    system = next(line for line in out.splitlines() if line.startswith("system"))
    words = system.split()[1:]
    assert len(words) == len(set(words)), system


def test_engine_lines_are_not_edgeinfers(tiny_llama_gguf: Path) -> None:
    done = _run(*CLI, "--debug", "run", str(tiny_llama_gguf), "-p", "Hi", "-n", "2",
                "--threads", "1", "--context-length", "64")  # fmt: skip
    assert done.returncode == 0, done.stderr
    engine = [line for line in done.stderr.splitlines() if "llama_model_loader" in line]
    assert engine and all(line.startswith("llama.cpp: ") for line in engine)


def _terminal_until(master: int, seen: bytes, done: Callable[[bytes], bool] | None, what: str,
                    within: float = 300) -> bytes:  # fmt: skip
    """``seen`` and what the terminal shows next, read until ``done(seen)`` (``None``: until
    the child closes it); no ``what`` within ``within`` seconds fails, with the screen."""
    import os
    import select
    import time

    deadline = time.monotonic() + within
    while done is None or not done(seen):
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no {what} within {within:.0f} s; the terminal showed {seen[-600:]!r}")
        ready, _, _ = select.select([master], [], [], min(left, 1.0))
        if not ready:
            continue
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child's side is closed
            chunk = b""
        if not chunk:
            if done is None:
                return seen
            pytest.fail(f"the chat ended before {what}; the terminal showed {seen[-600:]!r}")
        seen += chunk
    return seen


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux pseudo-terminal")
def test_chat_in_a_terminal_keeps_typing_out_of_replies(
    default_gguf: Path, kill_at_end: KillAtEnd
) -> None:
    """In a real (pseudo-)terminal: keys typed during a reply are neither echoed into it nor
    read as the next message, and Ctrl-D leaves the shell a fresh line. Each step waits for
    what the terminal shows, however slow the machine; the keys go in some 20 tokens into a
    reply of 120."""
    import os
    import pty

    master, slave = pty.openpty()
    try:
        proc = kill_at_end(subprocess.Popen(
            [*CLI, "chat", str(default_gguf), "--temperature", "0.8", "--seed", "3", "-n", "120",
             "--threads", "1", "--context-length", "1024"],  # one thread: no spinning peers
            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
        ))  # fmt: skip
    finally:
        os.close(slave)
    try:
        seen = _terminal_until(master, b"", lambda s: b">>> " in s, "first prompt")
        os.write(master, b"Write a long story about a dragon.\r")
        start = len(seen)
        seen = _terminal_until(master, seen, lambda s: len(s) >= start + 120, "reply")
        assert seen.count(b">>> ") == 1, "the reply ended before the keys were typed"
        os.write(master, b"TYPED-DURING-REPLY")  # while the reply streams
        seen = _terminal_until(master, seen, lambda s: s.count(b">>> ") >= 2, "second prompt")
        assert b"TYPED-DURING-REPLY" not in seen  # not echoed into the reply
        os.write(master, b"\x04")  # Ctrl-D at the prompt
        seen = _terminal_until(master, seen, None, "exit after Ctrl-D")
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(master)
    assert b"TYPED-DURING-REPLY" not in seen  # nor read as the next message
    assert seen.endswith(b"\r\n") or seen.endswith(b"\n")


@pytest.mark.model
def test_devices_plans_the_route_run_takes_for_an_npu(default_gguf: Path) -> None:
    """A catalog GGUF asked for an ONNX-only device runs through its ONNX graph: devices
    shows that plan, not llama.cpp's refusal."""
    done = _run(*CLI, "devices", "smollm2-135m-instruct", "--device", "npu", "--allow-fallback")
    assert done.returncode == 0, done.stderr
    assert "(gguf, run as onnx), device=npu" in done.stdout
    assert "CPUExecutionProvider: fallback" in done.stdout
