"""llama-cpp-python's sdist without what a CUDA build never reads, so it travels in 8 MB.

The 0.3.36 sdist is 77 MB: a git pack of llama.cpp's history (38 MB), the vocabulary GGUFs
of llama.cpp's tests, per-backend operator tables under docs/, benchmark results, the web
UI. None of it is read when CMake builds the library with LLAMA_BUILD_TESTS, _EXAMPLES,
_TOOLS and _SERVER off (their defaults when llama.cpp is a subproject) and LLAVA_BUILD off.
``slim(src, dest)`` writes the archive again without those paths and returns what it left
out, which ``gather.sh`` records beside it.

    python -m gpu_check.sdist SRC.tar.gz DEST.tar.gz
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import tarfile
from pathlib import Path, PurePosixPath

__all__ = ["DROPPED", "slim"]

# Paths under the sdist's top folder that a CUDA build of the library does not read.
DROPPED = (
    ".git",
    "docs",
    "examples",
    "tests",
    "docker",
    "vendor/llama.cpp/models",
    "vendor/llama.cpp/docs",
    "vendor/llama.cpp/benches",
    "vendor/llama.cpp/media",
    "vendor/llama.cpp/tests",
    "vendor/llama.cpp/examples",
    "vendor/llama.cpp/pocs",
    "vendor/llama.cpp/app",
    "vendor/llama.cpp/tools/ui",
    "vendor/llama.cpp/tools/server",
    "vendor/llama.cpp/skills",
    "vendor/llama.cpp/ci",
    "vendor/llama.cpp/gguf-py",
    "vendor/llama.cpp/conversion",
)


def _dropped(name: str) -> bool:
    parts = PurePosixPath(name).parts[1:]  # below the sdist's own top folder
    inner = "/".join(parts)
    return any(inner == d or inner.startswith(d + "/") for d in DROPPED)


def slim(src: Path, dest: Path) -> dict[str, object]:
    """Write ``src`` (a .tar.gz sdist) to ``dest`` without ``DROPPED``; links and members
    that leave the top folder are refused. Returns a summary: sizes, sha256 of both, the
    count of members left out."""
    kept = dropped = 0
    # gzip's own header holds no time (mtime=0): the same sdist slims to the same bytes
    with (
        tarfile.open(src, "r:gz") as tin,
        gzip.GzipFile(dest, "wb", mtime=0) as packed,
        tarfile.open(fileobj=packed, mode="w") as tout,
    ):
        for member in tin:
            path = PurePosixPath(member.name)
            if path.is_absolute() or ".." in path.parts:
                raise ValueError(f"{src}: member {member.name!r} leaves the archive's folder")
            if _dropped(member.name):
                dropped += 1
                continue
            if member.issym() or member.islnk():
                target = PurePosixPath(member.linkname)
                if target.is_absolute() or ".." in target.parts:
                    raise ValueError(f"{src}: link {member.name!r} points outside the archive")
            data = tin.extractfile(member) if member.isfile() else None
            tout.addfile(member, data)
            kept += 1
    return {
        "source": src.name,
        "source_bytes": src.stat().st_size,
        "source_sha256": _sha256(src),
        "slim_bytes": dest.stat().st_size,
        "slim_sha256": _sha256(dest),
        "members_kept": kept,
        "members_dropped": dropped,
        "dropped_paths": list(DROPPED),
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m gpu_check.sdist SRC.tar.gz DEST.tar.gz", file=sys.stderr)
        return 2
    src, dest = Path(argv[0]), Path(argv[1])
    if src.resolve() == dest.resolve():
        print("gpu_check.sdist: error: DEST must differ from SRC", file=sys.stderr)
        return 2
    print(json.dumps(slim(src, dest), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
