"""``edgeinfer bench`` against peers that misbehave and saved results that are damaged: a peer
that hangs is stopped at --timeout (with what it started) and left out with a note; a result
line cut short, garbled, deep or huge leaves that peer out; a damaged --from file is one line
on stderr and exit status 1. The CLI cases run the real command in a fresh process."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.bench.records import BenchResultError, check_run
from edgeinfer.bench.report import BenchReport
from edgeinfer.bench.runner import RunFailed, run_in_fresh_process
from edgeinfer.bounded_json import parse_json

DIRECT_EXAMPLES = 300
CLI_EXAMPLES = 12
ONE_RUN = ["-p", "8", "-n", "4", "-r", "1", "--warmup", "0", "--context-length", "64"]

# Stands in for ``python -m edgeinfer.bench.worker``: edgeinfer's run answers at once, the
# peer's does what FAKE_PEER says.
FAKE_WORKER = r"""
import json, os, subprocess, sys, time
MARK = "edgeinfer-bench-result "
spec = json.loads(sys.stdin.read())
ours = spec["engine"] == "edgeinfer"
mode = os.environ.get("FAKE_OURS", "ok") if ours else os.environ["FAKE_PEER"]
ok = {"tokens": spec["new_tokens"], "ttft_s": 0.1, "prefill_tok_s": 80.0,
      "decode_tok_s": 50.0 if ours else 40.0, "peak_rss_bytes": 1e8,
      "provider": "llama.cpp:CPU", "device": "cpu", "context_length": spec["context_length"],
      "plan_total_bytes": 2e8, "prompt_ids": list(range(spec["prompt_tokens"])), "ban_ids": [0]}
line = {
    "ok": json.dumps(ok),
    "truncated": json.dumps(ok)[:40],
    "deep": "[" * 100000 + "]" * 100000,
    "huge": '{"tokens": 1' + "0" * 100000 + "}",
    "big": '{"x": "' + "a" * (5 * 2**20) + '"}',
    "missing": json.dumps({k: v for k, v in ok.items() if k != "decode_tok_s"}),
    "wrong_type": json.dumps({**ok, "tokens": "4"}),
    "negative": json.dumps({**ok, "decode_tok_s": -1}),
    "nan": json.dumps({**ok, "ttft_s": float("nan")}),
    "error_shape": json.dumps({"error": "boom"}),
    "not_object": "[1, 2]",
    "no_ids": json.dumps({k: v for k, v in ok.items() if k != "prompt_ids"}),
}.get(mode)
if mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    time.sleep(3600)
elif mode == "garbage":
    sys.stdout.buffer.write(MARK.encode() + b"\xff\xfe\x00 garbage\n")
elif mode == "flood":
    sys.stdout.write("x" * (20 * 2**20) + "\n" + MARK + json.dumps(ok) + "\n")
elif mode == "escape":
    sys.stderr.write("\x1b[2J\x1b]0;pwned\x07 bad\nline two\n")
    sys.exit(3)
else:
    sys.stdout.write(MARK + line + "\n")
"""

DRIVER = (
    "import sys; import edgeinfer.bench.runner as runner; "
    "runner.WORKER = (sys.executable, sys.argv[1]); "
    "from edgeinfer.cli import main; sys.exit(main(sys.argv[2:]))"
)


@pytest.fixture(scope="module")
def fake_worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake-worker") / "worker.py"
    path.write_text(FAKE_WORKER)
    return path


@pytest.fixture
def fake_pids(tmp_path: Path, fake_worker: Path) -> Iterator[Path]:
    """Where a hanging fake worker writes its pid and its child's. Bench must end both (the
    tests check); one still running when the test ends is killed, so none outlives it."""
    path = tmp_path / "pids"
    yield path
    for pid in map(int, path.read_text().split() if path.exists() else []):
        with suppress(psutil.Error):
            proc = psutil.Process(pid)
            command = " ".join(proc.cmdline())
            if str(fake_worker) in command or "time.sleep(3600)" in command:
                proc.kill()


def bench_with_fake(
    worker: Path, model: Path, *args: str, env: dict[str, str], timeout: int = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(worker), "bench", str(model), *ONE_RUN, *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **env},
    )  # fmt: skip


# -- a peer that hangs ----------------------------------------------------------------------


def test_a_hanging_peer_is_stopped_and_left_out(
    fake_worker: Path, tiny_llama_gguf: Path, fake_pids: Path
) -> None:
    pids = fake_pids
    start = time.monotonic()
    out = bench_with_fake(
        fake_worker, tiny_llama_gguf, "--compare", "--json", "--timeout", "8",
        env={"FAKE_PEER": "hang", "FAKE_PIDS": str(pids)},
    )  # fmt: skip
    took = time.monotonic() - start
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and took < 120
    report = json.loads(out.stdout)
    assert [r["engine"] for r in report["results"]] == ["edgeinfer"]
    (note,) = report["notes"]
    assert "llama-cpp-python failed" in note and "longer than 8 s (--timeout)" in note
    worker_pid, child_pid = map(int, pids.read_text().split())
    time.sleep(0.5)
    for pid in (worker_pid, child_pid):  # the peer and what it started are gone
        gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert gone, pid


def test_the_table_says_which_peer_timed_out(
    fake_worker: Path, tiny_llama_gguf: Path, fake_pids: Path
) -> None:
    out = bench_with_fake(
        fake_worker, tiny_llama_gguf, "--compare", "--timeout", "8",
        env={"FAKE_PEER": "hang", "FAKE_PIDS": str(fake_pids)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "edgeinfer" in out.stdout.splitlines()[2]
    assert "llama-cpp-python failed on" in out.stdout and "--timeout" in out.stdout


def test_edgeinfer_itself_timing_out_is_one_line(
    fake_worker: Path, tiny_llama_gguf: Path, fake_pids: Path
) -> None:
    out = bench_with_fake(
        fake_worker, tiny_llama_gguf, "--timeout", "3",
        env={"FAKE_OURS": "hang", "FAKE_PEER": "ok", "FAKE_PIDS": str(fake_pids)},
    )  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if not ln.startswith("bench [")]
    assert len(lines) == 1 and "--timeout" in lines[0], out.stderr


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bad_timeout_is_one_line(value: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "bench", "m", "--timeout", value],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1 and "--timeout" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# -- peers' result lines ----------------------------------------------------------------------

DAMAGED_LINES = ["truncated", "deep", "huge", "big", "missing", "wrong_type", "negative", "nan",
                 "error_shape", "not_object", "garbage", "escape"]  # fmt: skip


@pytest.mark.parametrize("mode", DAMAGED_LINES)
def test_a_peer_with_a_damaged_result_is_left_out(
    fake_worker: Path, tiny_llama_gguf: Path, mode: str
) -> None:
    out = bench_with_fake(
        fake_worker, tiny_llama_gguf, "--compare", "--json", env={"FAKE_PEER": mode}
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    assert [r["engine"] for r in report["results"]] == ["edgeinfer"]
    (note,) = report["notes"]
    assert note.startswith("llama-cpp-python failed on") and note.isprintable(), note
    assert len(note) < 2100


@pytest.mark.parametrize("mode", ["truncated", "deep", "no_ids", "garbage"])
def test_edgeinfer_with_a_damaged_result_is_one_line(
    fake_worker: Path, tiny_llama_gguf: Path, mode: str
) -> None:
    out = bench_with_fake(fake_worker, tiny_llama_gguf, env={"FAKE_OURS": mode, "FAKE_PEER": "ok"})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if not ln.startswith("bench [")]
    assert len(lines) == 1 and "result line" in lines[0], out.stderr


def test_a_flood_of_output_still_finds_the_result(fake_worker: Path) -> None:
    os.environ["FAKE_PEER"] = "flood"
    try:
        spec = {"engine": "llama-cpp-python", "new_tokens": 4, "prompt_tokens": 8,
                "context_length": 64, "timeout_s": 60}  # fmt: skip
        run = run_in_fresh_process(spec, worker=(sys.executable, str(fake_worker)))
    finally:
        del os.environ["FAKE_PEER"]
    assert run["tokens"] == 4


def test_a_crash_names_its_status_in_one_printable_line(fake_worker: Path) -> None:
    os.environ["FAKE_PEER"] = "escape"
    try:
        with pytest.raises(RunFailed) as info:
            run_in_fresh_process(
                {"engine": "optimum", "new_tokens": 4, "prompt_tokens": 8, "context_length": 64},
                worker=(sys.executable, str(fake_worker)),
            )
    finally:
        del os.environ["FAKE_PEER"]
    message = str(info.value)
    assert "exited with status 3" in message and message.isprintable() and "line two" in message


# -- saved results (--from) -------------------------------------------------------------------


def saved_report() -> dict[str, Any]:
    report = BenchReport(
        settings={"repetitions": 2, "warmup": 1, "new_tokens": 4, "context_length": 64,
                  "models": ["m"], "prompt_tokens": [8, 16], "threads": [1]},
        machine={"cpu_model": "Test CPU", "physical_cores": 2, "arch": "x86_64"},
        versions={"edgeinfer": "0", "python": "3"},
        created="2025-01-01T00:00:00+00:00",
        command=["edgeinfer", "bench", "m"],
        notes=["skipping optimum: not installed here"],
    )  # fmt: skip
    for engine, speed in (("edgeinfer", 50.0), ("llama-cpp-python", 40.0)):
        for n_prompt in (8, 16):
            row = report.row("m", "/m.gguf", engine, "/m.gguf", 1, n_prompt, 4)
            for i in range(2):
                row.runs.append({
                    "tokens": 4, "ttft_s": 0.1 + i / 100, "prefill_tok_s": 80.0 + i,
                    "decode_tok_s": speed + i, "peak_rss_bytes": 1e8, "provider": "llama.cpp:CPU",
                    "device": "cpu", "context_length": 64,
                    "plan_total_bytes": 2e8 if engine == "edgeinfer" else None,
                })  # fmt: skip
    return report.to_dict()


BASE = saved_report()
BASE_TEXT = json.dumps(BASE, indent=1).encode()

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
              st.floats(allow_nan=False), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)  # fmt: skip


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found += paths(child, (*prefix, i))
    return found


ALL_PATHS = paths(BASE)[1:]


@st.composite
def structural(draw: st.DrawFn) -> bytes:
    """The saved report with one value replaced by another JSON value, or removed."""
    data = copy.deepcopy(BASE)
    path = draw(st.sampled_from(ALL_PATHS))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_values)
    return json.dumps(data).encode()


@st.composite
def byte_damage(draw: st.DrawFn) -> bytes:
    """The saved file cut short, or with bytes replaced, inserted or removed."""
    data = bytearray(BASE_TEXT)
    kind = draw(st.sampled_from(["cut", "replace", "insert", "remove"]))
    at = draw(st.integers(0, len(data) - 1))
    if kind == "cut":
        return bytes(data[:at])
    if kind == "replace":
        data[at : at + 1] = draw(st.binary(min_size=1, max_size=1))
    elif kind == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    else:
        del data[at : at + draw(st.integers(1, 40))]
    return bytes(data)


damaged = st.one_of(structural(), byte_damage())


def load(data: bytes) -> BenchReport | BenchResultError:
    """What --from does with ``data``: a report, or the one error it refuses with."""
    try:
        parsed = parse_json(data, what="r.json", error=BenchResultError)
        return BenchReport.from_dict(parsed, what="r.json")
    except BenchResultError as exc:
        return exc


@settings(max_examples=DIRECT_EXAMPLES, deadline=None)
@given(damaged)
def test_a_damaged_result_loads_whole_or_is_refused_in_one_line(data: bytes) -> None:
    got = load(data)
    if isinstance(got, BenchResultError):
        message = str(got)
        assert "\n" not in message and message.isprintable() and len(message) < 400, message
        assert "r.json" in message
        return
    # accepted: everything the command does with a report must work
    got.text()
    got.text(markdown=True)
    json.dumps(got.to_dict(), allow_nan=False)


@settings(
    max_examples=CLI_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(damaged)
def test_damaged_from_files_through_the_real_command(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(data)
    out = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "bench", "--from", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in out.stderr and out.returncode in (0, 1, 130), out.stderr
    if isinstance(load(data), BenchResultError):
        assert out.returncode == 1 and out.stdout == ""
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith(f"edgeinfer: error: --from {path}"), line


def test_the_saved_report_itself_loads_and_prints_the_same() -> None:
    report = load(BASE_TEXT)
    assert isinstance(report, BenchReport) and report.to_dict() == BASE


@pytest.mark.parametrize(
    "data, says",
    [
        (b"[" * 10000 + b"]" * 10000, "nested deeper"),
        (BASE_TEXT.replace(b'"threads": 1', b'"threads": 1' + b"0" * 100), "characters"),
        (BASE_TEXT.replace(b'"tokens": 4', b'"tokens": NaN'), "NaN"),
        (BASE_TEXT.replace(b"Test CPU", b"Test \\ud800"), "surrogate"),
        (BASE_TEXT.replace(b"Test CPU", b"Test \xff"), "UTF-8"),
        (BASE_TEXT.replace(b"Test CPU", b"\\u001b[2J"), "machine.cpu_model"),
        (BASE_TEXT.replace(b'"decode_tok_s": 50.0', b'"decode_tok_s": "fast"'),
         "results[0].runs[0].decode_tok_s must be a number"),
        (BASE_TEXT.replace(b'"runs": [', b'"runs": [1, '), "results[0].runs[0] must be an object"),
        (BASE_TEXT.replace(b'"repetitions": 2', b'"repetitions": true'), "settings.repetitions"),
        (BASE_TEXT.replace(b'"threads": 1', b'"threads": 0'), "results[0].threads"),
        (b'{"schema": "other"}', "not an edgeinfer bench result"),
    ],
)  # fmt: skip
def test_damage_is_named(data: bytes, says: str) -> None:
    got = load(data)
    assert isinstance(got, BenchResultError) and says in str(got), got


def test_from_a_fifo_or_a_folder_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, says in ((fifo, "not a regular file"), (tmp_path, "not a regular file")):
        out = subprocess.run(
            [sys.executable, "-m", "edgeinfer.cli", "bench", "--from", str(path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 1 and says in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_check_run_is_the_one_check_of_a_run() -> None:
    run = BASE["results"][0]["runs"][0]
    assert check_run(run) is run
    with pytest.raises(BenchResultError, match="prompt_ids is missing"):
        check_run(run, needs_ids=True)
    for key, bad in (("tokens", -1), ("tokens", 1.5), ("ttft_s", 1e300), ("provider", 3),
                     ("ban_ids", [-1]), ("engine_stats", {"x": "y"})):  # fmt: skip
        with pytest.raises(BenchResultError, match=f"{key} must be"):
            check_run({**run, key: bad})
