"""``edgeinfer batch``'s progress line on a terminal: drawn from the job's start (rows done of
the total, rows running, tokens/s), and a warning about a row printed on a line of its own
that names the row, never glued to the progress line. The real process on a pseudo-terminal,
and the meter in this process with a stream that says it is a terminal."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edgeinfer.batch.meter import Meter

from .faults import held_env
from .signals import sigint_default


def on_a_terminal(command: list[str], env: dict[str, str], limit: float = 300) -> tuple[int, str]:
    """Run ``command`` with its stderr on a pseudo-terminal; (exit status, what it drew)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env=env,
        preexec_fn=sigint_default,
    )
    os.close(slave)
    drawn, end = b"", time.monotonic() + limit
    try:
        while time.monotonic() < end:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child has closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(master)
    return proc.wait(timeout=60), drawn.decode("utf-8", "replace").replace("\r\n", "\n")


def visible_lines(drawn: str) -> list[str]:
    """What each line of the terminal shows at the end: the text after its last return."""
    return [line.rsplit("\r", 1)[-1].replace("\x1b[K", "") for line in drawn.split("\n")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal")
def test_progress_from_the_start_and_row_warnings_on_their_own_lines(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llguidance")
    regex = {"type": "regex", "pattern": "[a-z ]+"}
    rows = [{"id": f"plain{i}", "prompt": f"fox {i}", "max_tokens": 16} for i in range(4)]
    for i in (1, 3):  # a format the reply cannot finish in 2 tokens: a warning for that row
        rows.insert(i, {"id": f"fmt{i}", "prompt": "x", "max_tokens": 2, "response_format": regex})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    command = [sys.executable, "-m", "edgeinfer", "batch", str(tiny_llama_gguf), str(src)]
    status, drawn = on_a_terminal(
        [*command, "-o", str(tmp_path / "out.jsonl"), "--temperature", "0", "--threads", "1"],
        env=held_env(tmp_path, chunk_s=0.03),  # rows long enough to be seen running
    )
    assert status == 0, drawn
    assert "batch 0/6 rows done, 0 running" in drawn  # before any row has finished
    assert re.search(r"batch [0-5]/6 rows done, [12] running .* tok/s", drawn), drawn
    lines = visible_lines(drawn)
    warned = [line for line in lines if "response_format was complete" in line]
    assert [line.split(" (line")[0] for line in warned] == [
        "edgeinfer: row 'fmt1'",
        "edgeinfer: row 'fmt3'",
    ], drawn
    assert all("batch " not in line for line in warned)
    assert any(line.startswith("batch 6/6 rows done") for line in lines), drawn
    assert "Traceback" not in drawn


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_line_from_a_row_thread_goes_above_the_progress_line() -> None:
    terminal = _Terminal()
    handler = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        meter = Meter(3, terminal)
        with meter.showing():
            assert handler not in root.handlers  # wrapped for the job's life
            meter.add(1, 10, 0)
            worker = threading.Thread(target=lambda: logging.getLogger("x").warning("row 'a'"))
            worker.start()
            worker.join()
            meter.add(1, 10, 0)
        assert handler in root.handlers  # and given back
    finally:
        root.removeHandler(handler)
    drawn = terminal.getvalue()
    assert drawn.startswith("\r\x1b[Kbatch 0/3 rows done, 0 running")  # from the start
    lines = visible_lines(drawn)
    assert lines[0] == "row 'a'" and lines[1].startswith("batch 2/3 rows done") and lines[2] == ""
    assert len(lines) == 3


def test_a_meter_off_a_terminal_draws_nothing() -> None:
    stream = io.StringIO()
    meter = Meter(3, stream)
    with meter.showing():
        meter.add(3, 30, 1)
        meter.note("edgeinfer: a note")
    assert stream.getvalue() == "\nedgeinfer: a note\n"
