"""`edgeinfer chat --session NAME` for real: the conversation (messages and KV) outlives the
process; a damaged session is one clear line, never a crash or a wrong cache."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

SYSTEM = " ".join(f"Rule {i}: answer briefly." for i in range(3))


def _chat(model: Path, home: Path, lines: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EDGEINFER_HOME": str(home)}
    argv = [sys.executable, "-m", "edgeinfer.cli", "chat", str(model), "--threads", "1"]
    argv += ["--context-length", "256", "-n", "4", "--temperature", "0", *extra]
    return subprocess.run(
        argv, input=lines, capture_output=True, text=True, timeout=300, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def test_a_session_resumes_messages_and_kv(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    first = _chat(tiny_llama_gguf, tmp_path, "hello there\n", "--session", "s1", "--system", SYSTEM)
    assert first.returncode == 0, first.stderr[-2000:]
    folder = tmp_path / "sessions" / "s1"
    messages = json.loads((folder / "messages.json").read_text())
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert (folder / "state.kvs").stat().st_size > 0
    second = _chat(tiny_llama_gguf, tmp_path, "and again\n/stats\n", "--session", "s1")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed session s1: 3 messages" in second.stderr
    reused = int(re.search(r"reused (\d+)", second.stderr).group(1))  # type: ignore[union-attr]
    assert reused >= 32  # the first turn's prompt came from the snapshot, not read again
    messages = json.loads((folder / "messages.json").read_text())
    assert len(messages) == 5 and messages[3]["content"] == "and again"


@pytest.mark.parametrize(
    "damage",
    ["not json", "[1, 2]", '[{"role": "root", "content": "x"}]', "[" * 100000],
)
def test_damaged_messages_are_one_clear_line(
    tiny_llama_gguf: Path, tmp_path: Path, damage: str
) -> None:
    folder = tmp_path / "sessions" / "bad"
    folder.mkdir(parents=True)
    (folder / "messages.json").write_text(damage)
    out = _chat(tiny_llama_gguf, tmp_path, "hi\n", "--session", "bad")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "messages.json" in lines[0], out.stderr


def test_a_damaged_snapshot_is_read_again(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    assert _chat(tiny_llama_gguf, tmp_path, "hello\n", "--session", "k").returncode == 0
    state = tmp_path / "sessions" / "k" / "state.kvs"
    state.write_bytes(state.read_bytes()[:-9])
    out = _chat(tiny_llama_gguf, tmp_path, "more\n", "--session", "k")
    assert out.returncode == 0 and "Traceback" not in out.stderr
    assert "the conversation is read again" in out.stderr and "truncated" in out.stderr


@pytest.mark.parametrize("name", ["../x", ".hidden", "a/b", "", "x" * 65])
def test_bad_session_names_are_refused(tiny_llama_gguf: Path, tmp_path: Path, name: str) -> None:
    out = _chat(tiny_llama_gguf, tmp_path, "", "--session", name)
    assert out.returncode != 0 and "--session" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "x").exists()
