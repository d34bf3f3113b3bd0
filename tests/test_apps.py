from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

APPS = Path(__file__).resolve().parent.parent / "apps"


@pytest.mark.model
def test_device_chat_answers_each_line(default_gguf: Path) -> None:
    import edgeinfer
    from edgeinfer.files import catalog

    out = subprocess.run(
        [sys.executable, str(APPS / "device_chat.py"), "--max-new-tokens", "24", "--threads", "2"],
        input="What is the capital of France?\n\nName a color.\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    questions = ["What is the capital of France?", "Name a color."]
    assert [r["question"] for r in records] == questions
    assert all("answer" in r for r in records), records
    # each answer is the model's own greedy chat reply, computed here the same way (the app
    # loads the catalog name, so the same route is taken)
    with edgeinfer.load(catalog.DEFAULT_MODEL, threads=2) as model:
        expected = [
            model.chat([{"role": "user", "content": q}], max_new_tokens=24, temperature=0).text
            for q in questions
        ]
    assert [r["answer"] for r in records] == expected
    assert all(r["answer"].strip() for r in records)
