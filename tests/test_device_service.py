"""apps/device_service.py for real: JSON lines in and out, bad requests answered with an error
record while the service goes on, SIGTERM mid-reply ends that reply and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .leakcheck import KillAtEnd

SERVICE = Path(__file__).resolve().parents[1] / "apps" / "device_service.py"


def _start(model: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SERVICE), "--model", str(model), "--threads", "1", *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def test_json_lines_in_and_out_and_bad_requests(
    tiny_llama_gguf: Path, kill_at_end: KillAtEnd
) -> None:
    requests = [
        {"id": 1, "prompt": "Hello", "max_tokens": 4},
        "this is not json",
        {"id": 2, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        {"id": 3},
        {"id": 4, "prompt": "x", "temperature": -1},
        {"id": 5, "prompt": "Hello", "max_tokens": 2, "logit_bias": {"2": -100}},
    ]
    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in requests) + "\n"
    proc = kill_at_end(_start(tiny_llama_gguf, "--context-length", "128"))
    out, err = proc.communicate(text, timeout=120)
    assert proc.returncode == 0, err
    answers = [json.loads(line) for line in out.splitlines()]
    assert [a.get("id") for a in answers] == [1, None, 2, 3, 4, 5]
    assert answers[0]["finish_reason"] == "length" and answers[0]["usage"]["completion_tokens"] == 4
    assert answers[1]["error"]["type"] == "invalid_json"
    assert "prompt" in answers[3]["error"]["message"]
    assert "temperature" in answers[4]["error"]["message"]
    assert answers[5]["usage"]["completion_tokens"] == 2
    events = [json.loads(line)["event"] for line in err.splitlines()]
    assert events[:2] == ["loading", "ready"] and events[-1] == "stopped"


def test_budget_rule() -> None:
    sys.path.insert(0, str(SERVICE.parent))
    try:
        from device_service import board_budget
    finally:
        sys.path.pop(0)
    gib = 2**30
    assert board_budget(8 * gib, 7 * gib) == 6 * gib  # 75% of the RAM
    assert board_budget(1 * gib, 1 * gib) == 512 * 2**20  # at least 512 MiB left to the OS
    assert board_budget(8 * gib, 2 * gib) == 2 * gib  # never more than available


@pytest.mark.model
def test_sigterm_mid_reply_ends_it_and_exits_0(default_gguf: Path, kill_at_end: KillAtEnd) -> None:
    proc = kill_at_end(_start(default_gguf, "--context-length", "2048"))
    assert proc.stdin is not None and proc.stderr is not None
    assert json.loads(proc.stderr.readline())["event"] == "loading"
    assert json.loads(proc.stderr.readline())["event"] == "ready"
    long = {"id": "story", "prompt": "Once upon a time", "max_tokens": 2000,
            "temperature": 0.8, "seed": 1, "logit_bias": {"0": -100, "2": -100}}  # fmt: skip
    proc.stdin.write(json.dumps(long) + "\n")
    proc.stdin.flush()
    time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    (final,) = [json.loads(line) for line in out.splitlines()]
    assert final["id"] == "story" and final["finish_reason"] == "cancelled"
    made = final["usage"]["completion_tokens"]
    assert 0 < made < 2000
    assert "Traceback" not in err
    (answered,) = [r for r in map(json.loads, err.splitlines()) if r["event"] == "answered"]
    # "within a token": once the service saw the signal, the step under way ends (one token
    # may have been made but not yet handed over); nothing more is generated
    assert answered["tokens"] == made and 0 <= answered["tokens_after_stop"] <= 2, answered


def test_device_chat_answers_a_model_without_a_chat_template(no_template_model: Path) -> None:
    folder = no_template_model
    app = SERVICE.parent / "device_chat.py"
    done = subprocess.run(
        [sys.executable, str(app), "--model", str(folder), "--max-new-tokens", "3"],
        input="Hello\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr
    (record,) = [json.loads(line) for line in done.stdout.splitlines()]
    import edgeinfer

    with edgeinfer.load(folder) as model:  # a base model: the text is completed as it is
        assert model.chat_template is None
        want = model.generate("Hello", max_new_tokens=3, temperature=0)
    assert record["question"] == "Hello" and record["answer"] == want.text
    assert record["finish_reason"] == want.finish_reason
