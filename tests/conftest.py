from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import edgeinfer
from edgeinfer.files import catalog
from edgeinfer.model import Model

from . import hangcheck, leakcheck
from .fakes import FakeBackend

# A test that uses the real default model may fetch it and convert it (a Hugging Face
# checkpoint, ONNX folders, a GGUF) on the way: an hour before pytest-timeout fails it, not
# the suite's default (pyproject.toml), unless the test or its module names its own timeout.
MODEL_TIMEOUT_S = 3600
_Proc = TypeVar("_Proc", bound="subprocess.Popen[Any]")
_REAL_MODEL_FIXTURES = {"default_gguf", "default_model", "default_checkpoint", "default_onnx",
                        "default_gguf_f16"}  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    leakcheck.register(config)  # a test that leaves a child running fails, by name
    hangcheck.register(config)  # a test that SIGALRM cannot stop ends the run, by name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(config.pluginmanager.has_plugin(n) for n in ("timeout", "pytest_timeout")):
        return
    for item in items:
        real = item.get_closest_marker("model") or _REAL_MODEL_FIXTURES & set(
            getattr(item, "fixturenames", ())
        )
        if real and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(MODEL_TIMEOUT_S))


@pytest.fixture
def kill_at_end() -> Iterator[leakcheck.KillAtEnd]:
    """``kill_at_end(subprocess.Popen(...))`` is the process, ended when the test ends,
    whatever happened: killed with everything under it if it still runs, reaped, its pipes
    closed (tests/leakcheck.py fails a test that leaves one running)."""
    started: list[subprocess.Popen[Any]] = []

    def track(proc: _Proc) -> _Proc:
        started.append(proc)
        return proc

    yield track
    for proc in started:
        leakcheck.end_process(proc)


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Python's KeyboardInterrupt handler for SIGINT during the test (a suite started from a
    background job runs with SIGINT ignored)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture
def fake_model() -> Iterator[Model]:
    model = Model(FakeBackend(), name="fake", path=Path("fake"), model_format="fake")
    yield model
    model.close()


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF file, fetched once into $EDGEINFER_HOME."""
    return catalog.fetch(catalog.DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_model(default_gguf: Path) -> Iterator[Model]:
    model = edgeinfer.load(default_gguf, context_length=1024, threads=2)
    yield model
    model.close()


# Derived artifacts of the default model (its Hugging Face checkpoint, its ONNX conversions,
# its GGUF) are cached under $EDGEINFER_HOME/derived/<source sha256[:16]>-r<recipe>/, so only
# the first session pays for them. Each artifact is rebuilt when the code that builds it
# changes: beside it, ``<name>.key`` holds a hash of the converter's source files and of the
# libraries' versions it was built with (``_code_key``); a missing or different key is stale.
# Bump the recipe only to move every artifact at once.
_RECIPE = 2
_CONVERTERS = Path(__file__).resolve().parent.parent / "converters"
# what builds each artifact: converters/*.py ("."), and these folders of converters/ whole
_ROUTES = {
    "hf": (".", "sources"),
    "onnx": (".", "onnx", "sources"),
    "gguf": (".", "gguf", "sources"),
}
_LIBRARIES = ("onnx", "onnxruntime", "optimum", "transformers", "torch", "numpy")


def _derived_dir() -> Path:
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    assert entry.sha256 is not None
    return catalog.edgeinfer_home() / "derived" / f"{entry.sha256[:16]}-r{_RECIPE}"


def _code_key(route: str) -> str:
    """A hash of the source files that build ``route``'s artifacts and the versions of the
    libraries they call."""
    import hashlib
    from importlib import metadata

    digest = hashlib.sha256()
    for part in _ROUTES[route]:
        folder = _CONVERTERS / part
        files = folder.glob("*.py") if part == "." else folder.rglob("*.py")
        for path in sorted(files):
            digest.update(str(path.relative_to(_CONVERTERS)).encode() + b"\0" + path.read_bytes())
    for name in _LIBRARIES:
        try:
            digest.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name}=-;".encode())
    return digest.hexdigest()[:16]


def _fresh(artifact: Path, marker: Path, key: str) -> bool:
    """Whether ``artifact`` exists (``marker`` inside it, or itself) and was built by the
    code whose ``_code_key`` is ``key``."""
    stamp = artifact.with_name(artifact.name + ".key")
    return marker.is_file() and stamp.is_file() and stamp.read_text() == key


def _stamp(artifact: Path, key: str) -> None:
    """Record ``key``, taken before the build began (an edit during it leaves it stale)."""
    artifact.with_name(artifact.name + ".key").write_text(key)


@pytest.fixture(scope="session")
def default_checkpoint(default_gguf: Path) -> Path:
    """The default model dequantized to a Hugging Face checkpoint (fp32 safetensors)."""
    pytest.importorskip("transformers", reason="needs the convert extra")
    from edgeinfer.converters.atomic import atomic_output_dir
    from edgeinfer.converters.sources.checkpoint import checkpoint_from_gguf

    folder, key = _derived_dir() / "hf", _code_key("hf")
    if not _fresh(folder, folder / "config.json", key):
        with atomic_output_dir(folder, overwrite=True) as partial:
            checkpoint_from_gguf(default_gguf, partial)
        _stamp(folder, key)
    return folder


@pytest.fixture(scope="session")
def default_onnx(default_checkpoint: Path) -> Callable[[str], Path]:
    """quant -> the default model converted to ONNX with that quantization (validation run,
    its thresholds at 0 so that the folder exists whatever the figures; tests read them)."""
    from edgeinfer.converters import convert

    def get(quant: str) -> Path:
        folder, key = _derived_dir() / f"onnx-{quant}", _code_key("onnx")
        if not _fresh(folder, folder / "edgeinfer.json", key):
            convert(
                default_checkpoint,
                folder,
                quant=quant,
                overwrite=True,
                min_top1_agreement=0.0,
                min_greedy_agreement=0.0,
            )
            _stamp(folder, key)
        return folder

    return get


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama checkpoint with a byte-level BPE tokenizer."""
    pytest.importorskip("transformers", reason="needs the convert extra")
    from .tiny_hf import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="session")
def default_gguf_f16(default_checkpoint: Path) -> Path:
    """The default model's checkpoint written back as GGUF f16 by edgeinfer's own writer."""
    from edgeinfer.converters import convert

    out, key = _derived_dir() / "gguf" / "smollm2-f16.gguf", _code_key("gguf")
    if not _fresh(out, out, key):
        convert(default_checkpoint, out, to="gguf", quant="f16", overwrite=True)
        _stamp(out, key)
    return out


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama written as an f32 GGUF by edgeinfer's own writer."""
    from edgeinfer.converters import convert

    out = tmp_path_factory.mktemp("tiny-llama-gguf") / "tiny-f32.gguf"
    convert(tiny_hf, out, to="gguf", quant="f32")
    return out


@pytest.fixture(scope="session")
def tiny_qwen2_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint (q/k/v biases, untied output)."""
    pytest.importorskip("transformers", reason="needs the convert extra")
    from .tiny_hf import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2") / "hf", family="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen2_gguf(tiny_qwen2_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2 as an f32 GGUF by edgeinfer's writer."""
    from edgeinfer.converters import convert

    out = tmp_path_factory.mktemp("tiny-qwen2-gguf") / "tiny-qwen2-f32.gguf"
    convert(tiny_qwen2_hf, out, to="gguf", quant="f32")
    return out


@pytest.fixture(scope="session")
def tiny_llama_onnx(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama converted to an fp32 ONNX folder."""
    from edgeinfer.converters import convert

    out = tmp_path_factory.mktemp("tiny-llama-onnx") / "fp32"
    convert(tiny_hf, out, quant="fp32")
    return out


@pytest.fixture(scope="session")
def native_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, int], Path]:
    """``native_folder(gguf, max_context)``: the native builder's ONNX folder of a GGUF
    (edgeinfer's own transcode, as ``edgeinfer convert`` writes it), made once per session
    for each file and context."""
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    made: dict[tuple[Path, int], Path] = {}

    def make(gguf: Path, max_context: int) -> Path:
        key = (gguf, max_context)
        if key not in made:
            out = tmp_path_factory.mktemp("native") / gguf.stem
            out.mkdir()
            write_gguf_folder(gguf, out, max_context=max_context)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_gemma_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Gemma 3 checkpoint (sliding-window and global layers) with a
    SentencePiece vocabulary: byte pieces, Gemma's turn and image markers."""
    pytest.importorskip("transformers", reason="needs the convert extra")
    pytest.importorskip("sentencepiece", reason="needs sentencepiece (the test extra)")
    from .tiny_gemma import build_tiny_gemma_checkpoint

    return build_tiny_gemma_checkpoint(tmp_path_factory.mktemp("tiny-gemma") / "hf")


@pytest.fixture(scope="session")
def tiny_gemma_gguf(tiny_gemma_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 3 as an f32 GGUF (architecture gemma3, SentencePiece vocabulary)."""
    pytest.importorskip("gguf", reason="needs the convert extra")
    from .tiny_gemma import write_tiny_gemma_gguf

    out = tmp_path_factory.mktemp("tiny-gemma-gguf") / "tiny-gemma3-f32.gguf"
    return write_tiny_gemma_gguf(tiny_gemma_hf, out)


@pytest.fixture(scope="session")
def tiny_gemma_onnx(tiny_gemma_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 3 converted to an fp32 ONNX folder by edgeinfer's converter."""
    from edgeinfer.converters import convert

    out = tmp_path_factory.mktemp("tiny-gemma-onnx") / "fp32"
    convert(tiny_gemma_hf, out, quant="fp32", min_top1_agreement=0.0, min_greedy_agreement=0.0)
    return out


@pytest.fixture
def no_template_model(tiny_llama_gguf: Path, tmp_path: Path) -> Path:
    """The tiny model as a native ONNX folder whose manifest names no chat template."""
    pytest.importorskip("onnxruntime")
    import json

    from edgeinfer.converters.onnx.folder import write_gguf_folder

    folder = tmp_path / "plain"
    folder.mkdir()
    write_gguf_folder(tiny_llama_gguf, folder, max_context=128)
    (folder / "chat_template.jinja").unlink()
    manifest = json.loads((folder / "edgeinfer.json").read_text())
    manifest["chat_template_file"] = None
    (folder / "edgeinfer.json").write_text(json.dumps(manifest))
    return folder
