"""``edgeinfer embed``'s output, real processes on a tiny random BERT folder: an output that
is the input (the same file, a link to it, stdin or stdout on it) is refused before anything
is opened for writing; a full disk (a real tmpfs), a file size limit and /dev/full are one
error line, never a traceback, and never leave a half-written output in place of an old one;
a file output is replaced whole, through a link, with its mode kept."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.batch.output import OutputWriteError
from edgeinfer.errors import InvalidRequestError

from .bertgen import make_bert_folder
from .faults import file_size_limit, tmpfs

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")
pytest.importorskip("onnx")

TEXTS = b"hello world\nthe cat sat\non the mat!\n"


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """The model folder, and the environment of a child whose cache already holds its
    encoder graph (so the first run's "building" line is not among the lines checked)."""
    home = tmp_path_factory.mktemp("embed-home")
    folder = make_bert_folder(home.parent / f"{home.name}-bert", max_seq_length=16)
    env = dict(os.environ, EDGEINFER_HOME=str(home))
    done = embed(folder, env, input=TEXTS)
    assert done.returncode == 0, done.stderr
    yield folder, env


def embed(
    folder: Path,
    env: dict[str, str],
    *args: str | Path,
    stdin: Any = subprocess.DEVNULL,
    stdout: Any = subprocess.PIPE,
    **options: Any,
) -> subprocess.CompletedProcess[bytes]:
    if "input" in options:
        stdin = None
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer", "embed", str(folder), "--threads", "1"]
        + [str(a) for a in args],
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=300,
        check=False,
        **options,
    )


def one_error_line(done: subprocess.CompletedProcess[bytes]) -> str:
    stderr = done.stderr.decode()
    assert done.returncode == 1, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: "), stderr
    return lines[0]


# -- the output is the input ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["same", "symlink", "hardlink", "stdin", "stdout-append"])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(
    bert: tuple[Path, dict[str, str]], tmp_path: Path, kind: str
) -> None:
    folder, env = bert
    texts = tmp_path / "texts.txt"
    texts.write_bytes(TEXTS)
    if kind == "symlink":
        (tmp_path / "link.txt").symlink_to(texts)
    elif kind == "hardlink":
        os.link(texts, tmp_path / "link.txt")
    link = tmp_path / "link.txt"
    if kind == "stdin":
        with texts.open("rb") as stdin:
            done = embed(folder, env, "-o", texts, stdin=stdin)
    elif kind == "stdout-append":
        with texts.open("ab") as stdout:
            done = embed(folder, env, "-i", texts, stdout=stdout)
    else:
        done = embed(folder, env, "-i", texts, "-o", texts if kind == "same" else link)
    assert "is the input" in one_error_line(done)
    assert texts.read_bytes() == TEXTS


# -- a disk that fills up ---------------------------------------------------------------------


def _many_texts(path: Path, n: int = 400) -> Path:
    path.write_text("".join(f"cat {i}\n" for i in range(n)))
    return path


def _assert_old_output_kept(out: Path, line: str) -> None:
    assert out.read_bytes() == b"old records\n"
    assert f"{out} is left as it was" in line
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no partial output left


def test_a_full_disk_leaves_the_old_output(
    bert: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    folder, env = bert
    src = _many_texts(tmp_path / "texts.txt")
    with tmpfs(tmp_path / "disk", 16 << 10) as disk:
        out = disk / "out.jsonl"
        out.write_bytes(b"old records\n")
        line = one_error_line(embed(folder, env, "-i", src, "-o", out))
        assert "No space left on device" in line and "free some space" in line
        _assert_old_output_kept(out, line)


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE is POSIX")
def test_a_file_size_limit_leaves_the_old_output(
    bert: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    folder, env = bert
    src = _many_texts(tmp_path / "texts.txt")
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "out.jsonl"
    out.write_bytes(b"old records\n")
    done = embed(folder, env, "-i", src, "-o", out, preexec_fn=file_size_limit(16 << 10))
    line = one_error_line(done)
    assert "File too large" in line and "size limit" in line
    _assert_old_output_kept(out, line)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("how", ["-o", "stdout"])
def test_dev_full_is_one_line(bert: tuple[Path, dict[str, str]], tmp_path: Path, how: str) -> None:
    folder, env = bert
    src = _many_texts(tmp_path / "texts.txt")
    if how == "-o":
        done = embed(folder, env, "-i", src, "-o", "/dev/full")
    else:
        with open("/dev/full", "wb") as full:
            done = embed(folder, env, "-i", src, stdout=full)
    assert "No space left on device" in one_error_line(done)


# -- outputs that are not files, and the file replaced whole --------------------------------


@pytest.mark.parametrize("name", ["newdir/", "folder", "nowhere/out.jsonl"])
def test_an_output_that_is_no_file_is_one_line(
    bert: tuple[Path, dict[str, str]], tmp_path: Path, name: str
) -> None:
    folder, env = bert
    (tmp_path / "folder").mkdir()
    src = tmp_path / "texts.txt"
    src.write_bytes(TEXTS)
    one_error_line(embed(folder, env, "-i", src, "-o", f"{tmp_path}/{name}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "texts.txt"]


def test_an_old_output_is_replaced_whole_through_its_link_with_its_mode(
    bert: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    folder, env = bert
    src = tmp_path / "texts.txt"
    src.write_bytes(TEXTS)
    real = tmp_path / "real.jsonl"
    real.write_bytes(b"old records\n")
    real.chmod(0o600)
    link = tmp_path / "out.jsonl"
    link.symlink_to(real)
    done = embed(folder, env, "-i", src, "-o", link)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and stat.S_IMODE(real.stat().st_mode) == 0o600
    records = [json.loads(line) for line in real.read_text().splitlines()]
    assert [r["id"] for r in records] == [1, 2, 3] and all(r["embedding"] for r in records)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "real.jsonl", "texts.txt"]


# -- any output name (in this process) --------------------------------------------------------

names = st.text(st.sampled_from("ab./\\ é-_~\n"), min_size=1, max_size=12)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(names, st.booleans())
def test_any_output_name_is_written_whole_or_refused(tmp_path: Path, name: str, fail: bool) -> None:
    from edgeinfer.cli.embed import _check_output, _output

    work = tmp_path / "w"
    work.mkdir(exist_ok=True)
    (work / "sub").mkdir(exist_ok=True)
    src = work / "in.txt"
    src.write_bytes(TEXTS)
    out = f"{work}{os.sep}{name}"
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    try:
        _check_output(str(src), out)
    except InvalidRequestError:
        assert sorted(p.relative_to(work) for p in work.rglob("*")) == before
        return
    try:
        with _output(out) as f:
            f.write('{"id": 1}\n')
            if fail:
                raise OSError(28, "No space left on device")
    except OutputWriteError as exc:
        assert fail and "No space left on device" in str(exc)
        assert sorted(p.relative_to(work) for p in work.rglob("*")) == before  # nothing left
        return
    assert not fail and Path(out).read_bytes() == b'{"id": 1}\n'
    assert src.read_bytes() == TEXTS
    Path(out).unlink()


def test_edgeinfer_load_is_not_needed_to_refuse(tmp_path: Path) -> None:
    """The refusal comes before the model is loaded: a model that does not exist is not
    what the one error line is about."""
    texts = tmp_path / "texts.txt"
    texts.write_bytes(TEXTS)
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "embed", "no-such-model", "-i", str(texts), "-o",
         str(texts)],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert "is the input" in one_error_line(done)
    assert texts.read_bytes() == TEXTS
