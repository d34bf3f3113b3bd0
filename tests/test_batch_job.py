"""``edgeinfer batch``: real files, real processes. Ordering, records, resume after a partial
or torn output, bad rows and duplicate ids as error records, Ctrl-C and SIGKILL mid-job.

Exact comparisons run at --parallel 1 with greedy sampling, where the same job gives the
same bytes; the reference is always computed in the same session, never written down."""

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
from edgeinfer.batch import run_batch

KEYS = {"id", "text", "finish_reason", "usage", "parsed", "error"}


def cli(*args: str | Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer", "batch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(*args: str | Path) -> subprocess.Popen[str]:
    """The batch command as a process whose Ctrl-C is Python's, even when the tests run
    from a background job (which starts children with SIGINT ignored)."""
    return subprocess.Popen(
        [sys.executable, "-m", "edgeinfer", "batch", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def prompts(n: int, tokens: int = 12) -> list[dict]:
    words = ["fox", "Paris", "café", "add", "numbers", "brown", "dog", "emoji"]
    return [
        {"id": f"r{i}", "prompt": f"{words[i % 8]} {i} {words[(i * 3) % 8]}", "max_tokens": tokens}
        for i in range(n)
    ]


GREEDY = ("--temperature", "0", "--threads", "1")


def reference(model: Path, src: Path, out: Path) -> None:
    """The whole job in this process, uninterrupted, as the CLI runs it with GREEDY."""
    with edgeinfer.load(model, threads=1) as loaded:
        run_batch(loaded, src, out, temperature=0, progress=False)


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen[str], limit: float = 240) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end and proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the job wrote fewer than {n} lines ({proc.poll()=})")


@pytest.fixture(scope="module")
def tiny(tiny_llama_gguf: Path) -> Path:
    return tiny_llama_gguf


def test_help_names_the_flags() -> None:
    done = cli("--help")
    assert done.returncode == 0
    for flag in ("-o OUT", "--parallel", "--ray", "--choice", "--temperature", "resumes"):
        assert flag in done.stdout


def test_records_in_input_order_match_generate(tiny: Path, tmp_path: Path) -> None:
    rows: list[object] = prompts(12)
    rows[3] = {"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    rows[5] = {"prompt": "fox", "max_tokens": 3}  # no id: the line number
    rows[7] = {"id": 99, "prompt": "dog", "stop": ["o"], "seed": 1, "top_k": 5}
    src = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    done = cli(tiny, src, "-o", out, *GREEDY)
    assert done.returncode == 0, done.stderr
    got = records(out)
    assert [r["id"] for r in got] == [r.get("id", 6) for r in rows]  # type: ignore[union-attr]
    assert all(set(r) == KEYS and r["error"] is None for r in got)
    with edgeinfer.load(tiny, threads=1) as model:
        for row, rec in zip(rows, got, strict=True):
            assert isinstance(row, dict)
            fields = {k: v for k, v in row.items() if k not in ("id", "prompt", "messages")}
            fields["max_new_tokens"] = fields.pop("max_tokens", 256)
            if "messages" in row:
                ref = model.chat(row["messages"], temperature=0, **fields)
            else:
                ref = model.generate(row["prompt"], temperature=0, **fields)
            assert rec["text"] == ref.text
            assert rec["finish_reason"] == ref.finish_reason
            assert rec["usage"] == {
                "prompt_tokens": ref.stats.prompt_tokens,
                "completion_tokens": ref.stats.completion_tokens,
                "draft_tokens": 0,  # speculative decoding off: nothing drafted
                "accepted_tokens": 0,
            }


def test_bad_rows_become_error_records_and_the_job_goes_on(tiny: Path, tmp_path: Path) -> None:
    rows: list[object] = [
        {"id": "ok1", "prompt": "fox", "max_tokens": 2},
        "this is not json\n",
        "[1, 2]\n",
        {"id": "nop"},  # no prompt
        {"id": "both", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"id": "temp", "prompt": "a", "temperature": -1},
        {"id": "bias", "prompt": "a", "logit_bias": {"x": 1}},
        {"id": "long", "prompt": "fox " * 400},  # past the tiny model's 256-token context
        {"id": "fmt", "prompt": "a", "response_format": {"type": "choice", "choices": []}},
        {"id": 1.5, "prompt": "a"},
        {"id": "typo", "prompt": "a", "temprature": 0},
        {"id": "ok1", "prompt": "again"},  # duplicate
        "\n",  # blank: skipped
        {"id": "ok2", "prompt": "dog", "max_tokens": 2},
    ]
    src = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    done = cli(tiny, src, "-o", out, *GREEDY)
    assert done.returncode == 0, done.stderr
    got = records(out)
    ids = [r["id"] for r in got]
    bad = [2, 3, "nop", "both", "temp", "bias", "long", "fmt", 10, "typo", "ok1"]
    assert ids == ["ok1", *bad, "ok2"]
    errors = [r["error"] is not None for r in got]
    assert errors == [False] + [True] * 11 + [False]
    for rec in got[1:-1]:
        assert rec["error"]["type"] and rec["error"]["message"]
        assert rec["text"] is None and rec["usage"] is None
    assert "context" in got[7]["error"]["message"]
    assert got[11]["error"]["type"] == "DuplicateId"
    assert "(11 errors)" in done.stderr


def test_resume_after_a_partial_output_with_a_torn_line(tiny: Path, tmp_path: Path) -> None:
    rows = prompts(10)
    rows.insert(4, {"id": "r1", "prompt": "duplicate"})  # its error record resumes too
    src = write_rows(tmp_path / "in.jsonl", rows)
    whole = tmp_path / "whole.jsonl"
    reference(tiny, src, whole)
    expected = whole.read_bytes()
    lines = expected.splitlines(keepends=True)
    for keep in (0, 3, 5):
        out = tmp_path / f"out{keep}.jsonl"
        out.write_bytes(b"".join(lines[:keep]) + lines[keep][: len(lines[keep]) // 2])
        done = cli(tiny, src, "-o", out, *GREEDY)
        assert done.returncode == 0, done.stderr
        assert out.read_bytes() == expected
        assert f"{keep} rows were there already" in done.stderr or keep == 0
    again = cli(tiny, src, "-o", whole, *GREEDY)  # a finished job: nothing to do
    assert again.returncode == 0 and whole.read_bytes() == expected
    assert "0 records written" in again.stderr


def test_an_output_that_is_not_ours_is_refused(tiny: Path, tmp_path: Path) -> None:
    src = write_rows(tmp_path / "in.jsonl", prompts(2))
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "text": "x", "error": null}\nnotes of mine\n')
    done = cli(tiny, src, "-o", out)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "not a record of edgeinfer batch" in done.stderr
    assert out.read_text().endswith("notes of mine\n")  # untouched
    same = cli(tiny, src, "-o", src)
    assert same.returncode == 1 and "is the input" in same.stderr


LONG_JOB_ROWS = 300


def _a_long_job_under_way(
    tiny: Path, tmp_path: Path
) -> tuple[Path, Path, Path, subprocess.Popen[str]]:
    """The input, its whole reference output, the output path and a job process that has
    written its first few lines."""
    src = write_rows(tmp_path / "in.jsonl", prompts(LONG_JOB_ROWS, tokens=40))
    whole = tmp_path / "whole.jsonl"
    reference(tiny, src, whole)
    out = tmp_path / "out.jsonl"
    proc = start(tiny, src, "-o", out, *GREEDY, "--parallel", "1")
    wait_for_lines(out, 5, proc)
    return src, whole, out, proc


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_mid_job_leaves_a_file_that_resumes(
    tiny: Path, tmp_path: Path, presses: int
) -> None:
    src, whole, out, proc = _a_long_job_under_way(tiny, tmp_path)
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "run the same command again to resume" in stderr
    partial = out.read_bytes()
    assert partial.endswith(b"\n") and whole.read_bytes().startswith(partial)
    assert partial.count(b"\n") < LONG_JOB_ROWS
    done = cli(tiny, src, "-o", out, *GREEDY)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == whole.read_bytes()


def test_sigkill_mid_job_damages_no_line_and_resumes(tiny: Path, tmp_path: Path) -> None:
    src, whole, out, proc = _a_long_job_under_way(tiny, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    left = out.read_bytes()
    complete = left[: left.rfind(b"\n") + 1]
    assert whole.read_bytes().startswith(complete)  # every whole line is the job's own
    done = cli(tiny, src, "-o", out, *GREEDY)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == whole.read_bytes()


def test_concurrent_rows_keep_input_order(tiny: Path, tmp_path: Path) -> None:
    """Rows of very different lengths, many in flight: the output is still in input order
    and holds every row once (whatever the model's slots)."""
    rows = [dict(r, max_tokens=1 + (i * 7) % 40) for i, r in enumerate(prompts(40))]
    src = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    with edgeinfer.load(tiny, threads=1) as model:
        summary = run_batch(model, src, out, parallel=4, temperature=0, progress=False)
    assert summary.written == 40 and summary.errors == 0
    got = records(out)
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    assert all(
        r["usage"]["completion_tokens"] <= row["max_tokens"]
        for r, row in zip(got, rows, strict=True)
    )


def test_choice_rows_answer_with_a_label(tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("llguidance")
    labels = ["billing", "bug", "account", "feature", "other"]
    fmt = {"type": "choice", "choices": labels}
    rows = [{"id": i, "prompt": f"ticket {i}:", "response_format": fmt} for i in range(6)]
    src = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    done = cli(tiny, src, "-o", out, *GREEDY)
    assert done.returncode == 0, done.stderr
    assert all(r["text"] in labels for r in records(out))


def test_csv_input(tiny: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_text(
        'id,prompt,max_tokens,temperature,stop\n1,fox,3,0,\n2,"dog, café",2,0,"[""o""]"\n'
        "3,,2,0,\n4,fox,many,0,\n"
    )
    out = tmp_path / "out.jsonl"
    done = cli(tiny, src, "-o", out, *GREEDY)
    assert done.returncode == 0, done.stderr
    got = records(out)
    assert [r["id"] for r in got] == ["1", "2", "3", "4"]  # a CSV id is its text
    assert [r["error"] is None for r in got] == [True, True, False, False]
    assert got[0]["usage"]["completion_tokens"] <= 3


def test_parallel_slots_ctrl_c_and_resume_give_every_row_once(tiny: Path, tmp_path: Path) -> None:
    """At --parallel 4 the model batches the rows in flight; greedy output may differ in the
    last bits from one slot's (kernels change with the batch), so the file is checked for
    order and completeness, not bytes."""
    rows = prompts(200, tokens=40)
    src = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    proc = start(tiny, src, "-o", out, *GREEDY, "--parallel", "4")
    wait_for_lines(out, 8, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert records(out)  # whole lines only
    done = cli(tiny, src, "-o", out, *GREEDY, "--parallel", "4")
    assert done.returncode == 0, done.stderr
    got = records(out)
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    assert all(r["error"] is None and 1 <= r["usage"]["completion_tokens"] <= 40 for r in got)
