"""``edgeinfer batch`` against its output's faults, real processes: a second job on the same
output, an output that names a folder, is a device or is read-only, a disk that fills up
(a real tmpfs, a file size limit), and Ray refusing its flags. Each is one
``edgeinfer: error:`` line that names the fix; what was written is left whole, and running
the same command again completes every row exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.batch import run_batch
from edgeinfer.batch.output import OutputFile, check_output
from edgeinfer.errors import InvalidRequestError

from .faults import file_size_limit, held_env, remount, tmpfs
from .signals import sigint_default

GREEDY = ("--temperature", "0", "--threads", "1")


def batch(*args: str | Path, **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer", "batch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **options,  # type: ignore[call-overload]
    )


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: "), done.stderr
    return lines[0]


def job_file(path: Path, n: int = 24, tokens: int = 12) -> Path:
    rows = [{"id": f"r{i}", "prompt": f"fox {i} dog", "max_tokens": tokens} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def whole_job(model: Path, src: Path, out: Path) -> bytes:
    """The job's whole output, in this process, uninterrupted (as GREEDY runs it)."""
    with edgeinfer.load(model, threads=1) as loaded:
        run_batch(loaded, src, out, temperature=0, progress=False)
    return out.read_bytes()


def assert_whole_lines_of(left: bytes, whole: bytes) -> None:
    assert left == b"" or left.endswith(b"\n")
    assert whole.startswith(left)


# -- one job per output ----------------------------------------------------------------------


def test_a_second_job_on_the_same_output_is_refused(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    src = job_file(tmp_path / "in.jsonl")
    whole = whole_job(tiny_llama_gguf, src, tmp_path / "whole.jsonl")
    out, gate = tmp_path / "out.jsonl", tmp_path / "gate"
    gate.touch()  # the first job holds the output, its rows held until the gate goes
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgeinfer",
            "batch",
            str(tiny_llama_gguf),
            str(src),
            "-o",
            str(out),
            *GREEDY,
        ],
        env=held_env(tmp_path, gate=gate),
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )
    try:
        deadline = time.monotonic() + 120
        while not out.exists():  # created once the first job has locked it
            assert first.poll() is None and time.monotonic() < deadline, first.poll()
            time.sleep(0.02)
        second = batch(tiny_llama_gguf, src, "-o", out, *GREEDY)
        assert "another edgeinfer batch job is writing" in one_error_line(second)
        assert first.poll() is None  # the refusal came while the first job held the output
    finally:
        gate.unlink()
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert out.read_bytes() == whole  # every row once, the first job's alone
    again = batch(tiny_llama_gguf, src, "-o", out, *GREEDY)
    assert again.returncode == 0 and "0 records written" in again.stderr
    assert out.read_bytes() == whole


# -- outputs that cannot hold the records ----------------------------------------------------


@pytest.mark.parametrize("kind", ["slash", "folder", "device", "no-folder"])
def test_an_output_that_is_no_file_is_one_line(tmp_path: Path, kind: str) -> None:
    src = job_file(tmp_path / "in.jsonl", n=2)
    (tmp_path / "folder").mkdir()
    out = {
        "slash": f"{tmp_path / 'newdir'}/",
        "folder": str(tmp_path / "folder"),
        "device": "/dev/full",
        "no-folder": str(tmp_path / "nowhere" / "out.jsonl"),
    }[kind]
    line = one_error_line(batch("no-such-model", src, "-o", out))  # refused before loading
    fix = {"slash": "give a file", "folder": "give a file", "device": "give a file path"}
    assert fix.get(kind, "create it") in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "in.jsonl"]


def test_a_read_only_output_is_one_line_and_left_as_it_was(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    src = job_file(tmp_path / "in.jsonl", n=4)
    with tmpfs(tmp_path / "disk", 1 << 20) as disk:
        out = disk / "out.jsonl"
        whole = whole_job(tiny_llama_gguf, src, out)
        out.write_bytes(whole.splitlines(keepends=True)[0])
        remount(disk, "ro")
        line = one_error_line(batch(tiny_llama_gguf, src, "-o", out, *GREEDY))
        assert "Read-only file system" in line and "write elsewhere" in line
        assert out.read_bytes() == whole.splitlines(keepends=True)[0]
        remount(disk, "rw")
        done = batch(tiny_llama_gguf, src, "-o", out, *GREEDY)
        assert done.returncode == 0, done.stderr
        assert out.read_bytes() == whole


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anything")
def test_a_write_protected_output_is_one_line(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    src = job_file(tmp_path / "in.jsonl", n=2)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"")
    out.chmod(0o444)
    assert "Permission denied" in one_error_line(batch(tiny_llama_gguf, src, "-o", out))


# -- a disk that fills up ---------------------------------------------------------------------


def _fill_then_resume(model: Path, src: Path, out: Path, whole: bytes, **options: object) -> str:
    """Run the job until the disk is full: one line, whole records left; return the line."""
    line = one_error_line(batch(model, src, "-o", out, *GREEDY, **options))
    left = out.read_bytes()
    assert_whole_lines_of(left, whole)
    assert 0 < len(left) < len(whole)
    assert "run the same command again to resume" in line
    return line


def test_a_full_tmpfs_is_one_line_and_the_job_resumes(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    src = job_file(tmp_path / "in.jsonl", n=120, tokens=30)
    whole = whole_job(tiny_llama_gguf, src, tmp_path / "whole.jsonl")
    assert len(whole) > 16 << 10
    with tmpfs(tmp_path / "disk", 8 << 10) as disk:
        out = disk / "out.jsonl"
        line = _fill_then_resume(tiny_llama_gguf, src, out, whole)
        assert "No space left on device" in line and "free some space" in line
        remount(disk, "size=1m")
        done = batch(tiny_llama_gguf, src, "-o", out, *GREEDY)
        assert done.returncode == 0, done.stderr
        assert out.read_bytes() == whole


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE is POSIX")
def test_a_file_size_limit_is_one_line_and_the_job_resumes(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    src = job_file(tmp_path / "in.jsonl", n=30)
    whole = whole_job(tiny_llama_gguf, src, tmp_path / "whole.jsonl")
    out = tmp_path / "out.jsonl"
    limit = len(whole) // 3
    line = _fill_then_resume(tiny_llama_gguf, src, out, whole, preexec_fn=file_size_limit(limit))
    assert "File too large" in line and "size limit" in line
    assert len(out.read_bytes()) <= limit
    done = batch(tiny_llama_gguf, src, "-o", out, *GREEDY)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == whole


# -- Ray refusing its flags -------------------------------------------------------------------

_FAKE_RAY = """\
class _Exceptions:
    class RayError(Exception):
        pass


exceptions = _Exceptions


def is_initialized():
    return False


def init(address=None, **options):
    raise ConnectionError(
        f"Could not find any running Ray instance at {address!r}.\\nPlease specify one."
    )
"""


@pytest.mark.parametrize("address", ["ray://nowhere.invalid:1", "auto"])
def test_ray_refusing_its_address_is_one_line(
    tiny_llama_gguf: Path, tmp_path: Path, address: str
) -> None:
    """A stand-in for Ray that refuses every address as Ray does (ConnectionError, a
    message over several lines): the job says so in one line, the output stays as it was."""
    fake = tmp_path / "fake"
    (fake / "ray").mkdir(parents=True)
    (fake / "ray" / "__init__.py").write_text(_FAKE_RAY)
    src = job_file(tmp_path / "in.jsonl", n=3)
    out = tmp_path / "out.jsonl"
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    line = one_error_line(batch(tiny_llama_gguf, src, "-o", out, f"--ray={address}", env=env))
    assert f"Ray did not start at {address}" in line and "check --ray ADDRESS" in line
    assert "ConnectionError: Could not find any running Ray instance" in line
    assert out.read_bytes() == b""


# -- any output name --------------------------------------------------------------------------

names = st.text(st.sampled_from("ab./\\ é-_~\n"), min_size=1, max_size=12)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(names)
def test_any_output_name_is_a_file_there_or_refused(tmp_path: Path, name: str) -> None:
    work = tmp_path / "w"
    work.mkdir(exist_ok=True)
    (work / "sub").mkdir(exist_ok=True)
    src = work / "in.jsonl"
    src.write_bytes(b'{"prompt": "x"}\n')
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    try:
        path = check_output(f"{work}{os.sep}{name}", src)  # as text: a final / stays
    except InvalidRequestError as exc:
        assert str(exc).startswith("the output")
        assert sorted(p.relative_to(work) for p in work.rglob("*")) == before  # untouched
        return
    assert not name.endswith(("/", os.sep)) and path.parent.is_dir() and not path.is_dir()
    with OutputFile(path) as out:
        out.append([b'{"id": 1, "error": null}\n'])
    assert path.is_file() and src.read_bytes() == b'{"prompt": "x"}\n'
    path.unlink()


def test_the_real_ray_refusing_an_address_is_one_line(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("ray", reason="needs edgeinfer[ray]")
    src = job_file(tmp_path / "in.jsonl", n=2)
    out = tmp_path / "out.jsonl"
    line = one_error_line(batch(tiny_llama_gguf, src, "-o", out, "--ray=nowhere:port"))
    assert "Ray did not start at nowhere:port: ValueError" in line
    assert out.read_bytes() == b""
