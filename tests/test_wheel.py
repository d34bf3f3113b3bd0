"""The package as a user gets it.

`python -m build` makes the sdist and, from it, the wheel; the wheel is installed into a fresh
venv and used from a folder outside the checkout, so nothing can be imported from the tree.
There every module imports, the console script answers, `edgeinfer run` streams from a tiny
GGUF and `edgeinfer serve` answers one request. The wheel holds every file of the three
source folders (so every data file the code opens), the wheel built straight from the tree
holds the same files, and the metadata passes `twine check`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

import edgeinfer

from . import ggufgen

pytestmark = pytest.mark.timeout(1800)  # two isolated builds and a venv with the engines

ROOT = Path(__file__).resolve().parent.parent
# folder in the repository -> where its files sit inside the wheel
SOURCES = {
    "edgeinfer": "edgeinfer",
    "runtimes": "edgeinfer/runtimes",
    "converters": "edgeinfer/converters",
}
# what the fresh venv installs beside the wheel: the engines `run` and `serve` need
EXTRAS = "gguf,onnx,serve"


def _run(argv: list[str | Path], **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{argv}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@dataclass
class Dist:
    sdist: Path
    wheel: Path  # built from the sdist, as pip and PyPI build it
    direct: Path  # built straight from a copy of the tree


def _tree_copy(into: Path) -> Path:
    """The checkout's files without what a build or a venv left in it (a stale build/ folder
    would put removed modules back into a wheel)."""
    skip = shutil.ignore_patterns(
        ".git",
        ".venv",
        "build",
        "dist",
        "*.egg-info",
        "__pycache__",
        ".pytest_cache",
        ".hypothesis",
        ".ruff_cache",
        "site",
    )
    return Path(shutil.copytree(ROOT, into / "tree", ignore=skip, symlinks=True))


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    work = tmp_path_factory.mktemp("build")
    tree = _tree_copy(work)
    out, direct = work / "dist", work / "direct"
    _run([sys.executable, "-m", "build", "--outdir", out, tree])
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", direct, tree])
    (sdist,), (wheel,), (straight,) = out.glob("*.tar.gz"), out.glob("*.whl"), direct.glob("*.whl")
    return Dist(sdist, wheel, straight)


def _wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


def test_the_wheel_holds_every_file_of_the_source_folders(dist: Dist) -> None:
    want = set()
    for folder, target in SOURCES.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                want.add(f"{target}/{path.relative_to(ROOT / folder).as_posix()}")
    got = _wheel_files(dist.wheel)
    assert want - got == set(), "files of the tree missing from the wheel"
    assert got - want == set(), "files in the wheel that the tree does not have"


def test_the_wheel_from_the_sdist_equals_the_wheel_from_the_tree(dist: Dist) -> None:
    assert _wheel_files(dist.wheel) == _wheel_files(dist.direct)
    with tarfile.open(dist.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        assert needed in names


def test_the_repository_holds_no_symlinks() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    links = [
        line.split("\t", 1)[1] for line in tracked.stdout.splitlines() if line.startswith("120000")
    ]
    assert links == []


def test_the_metadata_is_complete_and_twine_clean(dist: Dist) -> None:
    _run([sys.executable, "-m", "twine", "check", "--strict", dist.sdist, dist.wheel])
    with zipfile.ZipFile(dist.wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = z.read(name).decode()
    assert f"Version: {edgeinfer.__version__}\n" in meta
    assert "License-Expression: Apache-2.0\n" in meta
    assert meta.count("Classifier: ") >= 5
    assert meta.count("Project-URL: ") >= 2
    assert "Description-Content-Type: text/markdown" in meta


@dataclass
class Venv:
    bin: Path
    outside: Path  # a folder outside the checkout, the working directory of every call
    env: dict[str, str]

    def run(self, *argv: str | Path, **kwargs) -> subprocess.CompletedProcess[str]:
        return _run(list(argv), cwd=self.outside, env=self.env, **kwargs)


@pytest.fixture(scope="module")
def venv(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    home = tmp_path_factory.mktemp("user")
    _run([sys.executable, "-m", "venv", home / "venv"])
    bin_ = home / "venv" / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "EDGEINFER_HOME": str(home / "edgeinfer-home"),
        "PATH": f"{bin_}{os.pathsep}{env['PATH']}",
    }
    outside = home / "work"
    outside.mkdir()
    v = Venv(bin_, outside, env)
    v.run(bin_ / "python", "-m", "pip", "install", "-q", f"{dist.wheel}[{EXTRAS}]")
    return v


def test_every_module_imports_from_the_installed_wheel(venv: Venv) -> None:
    code = (
        "import importlib, json, pkgutil, edgeinfer\n"
        "found = pkgutil.walk_packages(edgeinfer.__path__, 'edgeinfer.')\n"
        "names = ['edgeinfer'] + [m.name for m in found if not m.name.endswith('.__main__')]\n"
        "failed = {}\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed[name] = repr(exc)\n"
        "print(json.dumps({'file': edgeinfer.__file__, 'names': names, 'failed': failed}))\n"
    )
    walk = json.loads(venv.run(venv.bin / "python", "-c", code).stdout)
    assert Path(walk["file"]).is_relative_to(venv.bin.parent), "edgeinfer came from elsewhere"
    assert not Path(walk["file"]).is_relative_to(ROOT)
    assert {
        "edgeinfer.runtimes.base",
        "edgeinfer.converters.onnx.builder",
        "edgeinfer.generation.state",
    } <= set(walk["names"])
    assert walk["failed"] == {}


def test_help_and_version_answer(venv: Venv) -> None:
    assert "serve" in venv.run(venv.bin / "edgeinfer", "--help").stdout
    printed = venv.run(venv.bin / "edgeinfer", "--version").stdout.split()
    installed = venv.run(
        venv.bin / "python",
        "-c",
        "from importlib import metadata; print(metadata.version('edgeinfer'))",
    ).stdout.strip()
    assert printed == ["edgeinfer", installed]
    assert installed == edgeinfer.__version__ == metadata.version("edgeinfer")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ggufgen.tiny_llama().write(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


RUN = ["run", "-p", "Hello there", "-n", "8", "--temperature", "0", "--threads", "1", "--json"]


def test_run_streams_from_a_tiny_gguf_as_the_checkout_does(venv: Venv, tiny_gguf: Path) -> None:
    got = json.loads(venv.run(venv.bin / "edgeinfer", RUN[0], tiny_gguf, *RUN[1:]).stdout)
    want = json.loads(_run([sys.executable, "-m", "edgeinfer", RUN[0], tiny_gguf, *RUN[1:]]).stdout)
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    streamed = venv.run(venv.bin / "edgeinfer", RUN[0], tiny_gguf, *RUN[1:-1])
    assert streamed.stdout.rstrip("\n") == want["text"].rstrip("\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(venv: Venv, tiny_gguf: Path) -> Iterator[str]:
    port = _free_port()
    argv = [venv.bin / "edgeinfer", "serve", tiny_gguf, "--port", str(port), "--threads", "1"]
    process = subprocess.Popen(
        [str(a) for a in argv],
        cwd=venv.outside,
        env=venv.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_serve_answers_one_request(served: str, tiny_gguf: Path) -> None:
    body = {
        "model": str(tiny_gguf),
        "prompt": "Hello there",
        "max_tokens": 4,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{served}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.load(reply)
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{exc}: {exc.read().decode(errors='replace')}")
    assert answer["object"] == "text_completion"
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] <= 4
