from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

APPS = Path(__file__).resolve().parent.parent / "apps"


@pytest.mark.model
def test_device_chat_answers_each_line(default_gguf: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(APPS / "device_chat.py"), "--max-new-tokens", "24"],
        input="What is the capital of France?\n\nName a color.\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["question"] for r in records] == ["What is the capital of France?", "Name a color."]
    assert all(r["answer"] for r in records)
