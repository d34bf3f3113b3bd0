"""The second Ctrl-C of ``edgeinfer batch`` abandons the rows in flight: a real process, the
rows surely in flight when it comes (their streams are held by a gate, tests/faults.py), and
SIGINT twice. No record of a row that did not finish is written (resume would skip a row
that never ran); the output is a prefix of the whole job's, and running the same command
again completes every row exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.batch import run_batch

from .faults import held_env
from .signals import sigint_default

GREEDY = ("--temperature", "0", "--threads", "1")
ROWS = 16


class _Lines:
    """A child's stderr, read as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        self.text = ""
        self._stream = proc.stderr
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._stream:
            self.text += line

    def wait_for(self, words: str, proc: subprocess.Popen[str], limit: float = 120) -> None:
        end = time.monotonic() + limit
        while words not in self.text:
            assert proc.poll() is None and time.monotonic() < end, self.text
            time.sleep(0.02)

    def join(self) -> str:
        self._thread.join(timeout=60)
        return self.text


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen[str]) -> None:
    end = time.monotonic() + 240
    while not (path.exists() and path.read_bytes().count(b"\n") >= n):
        assert proc.poll() is None and time.monotonic() < end, proc.poll()
        time.sleep(0.02)


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_the_second_ctrl_c_writes_no_row_that_did_not_finish(
    tiny_llama_gguf: Path, tmp_path: Path, parallel: str
) -> None:
    rows = [{"id": f"r{i}", "prompt": f"fox {i} dog", "max_tokens": 24} for i in range(ROWS)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = tmp_path / "whole.jsonl"
    with edgeinfer.load(tiny_llama_gguf, threads=1) as model:
        run_batch(model, src, whole, temperature=0, progress=False)
    out, gate = tmp_path / "out.jsonl", tmp_path / "gate"
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer", "batch", str(tiny_llama_gguf), str(src), "-o",
         str(out), *GREEDY, "--parallel", parallel],
        env=held_env(tmp_path, chunk_s=0.05, gate=gate, cancel_s=0.3),
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )  # fmt: skip
    stderr = _Lines(proc)
    _wait_for_lines(out, 2, proc)
    gate.touch()  # from here every row in flight is held mid-way
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stderr.wait_for("finishing the rows in flight", proc)
    gate.unlink()  # the rows go on, a chunk each 50 ms: none can finish before the next
    proc.send_signal(signal.SIGINT)  # which cancels them; each has ended cancelled before
    # the job looks at its rows again (cancel_s), as it may on a busy machine
    assert proc.wait(timeout=120) == 130, stderr.join()
    assert "run the same command again to resume" in stderr.join()
    left = out.read_bytes()
    records = [json.loads(line) for line in left.splitlines()]
    assert all(r["finish_reason"] != "cancelled" for r in records), records
    assert left.endswith(b"\n") and 2 <= len(records) < ROWS
    assert [r["id"] for r in records] == [r["id"] for r in rows[: len(records)]]
    if parallel == "1":  # one slot: the same bytes as the whole job's (batched slots may
        assert whole.read_bytes().startswith(left)  # differ in the last bits of a float)
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "batch", str(tiny_llama_gguf), str(src), "-o",
         str(out), *GREEDY, "--parallel", parallel],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["id"] for r in got] == [r["id"] for r in rows]  # every row once, in order
    assert all(r["error"] is None and r["finish_reason"] != "cancelled" for r in got)
    if parallel == "1":
        assert out.read_bytes() == whole.read_bytes()
