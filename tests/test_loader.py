"""What load() does with paths that are not a usable model: always ModelLoadError."""

from __future__ import annotations

from pathlib import Path

import pytest

import edgeinfer
from edgeinfer import ModelLoadError
from edgeinfer.loader import resolve

from .ggufgen import write_gguf


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        edgeinfer.load(tmp_path / "nope.gguf")


def test_unknown_name() -> None:
    with pytest.raises(ModelLoadError, match="catalog"):
        edgeinfer.load("no-such-model-anywhere")


def test_folder_without_a_model(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="holds no model"):
        edgeinfer.load(tmp_path)


def test_text_file_renamed_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model\n" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        edgeinfer.load(path)


def test_other_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x80\x02" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a model edgeinfer can run"):
        edgeinfer.load(path)


def test_folder_with_one_gguf_resolves_to_it(tmp_path: Path) -> None:
    write_gguf(tmp_path / "only.gguf")
    assert resolve(tmp_path).path == tmp_path / "only.gguf"
    write_gguf(tmp_path / "second.gguf")
    with pytest.raises(ModelLoadError, match="several"):
        resolve(tmp_path)


def test_bad_load_arguments_are_typed_errors(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    with pytest.raises(edgeinfer.InvalidRequestError, match="context_length"):
        edgeinfer.load(path, context_length=0)
    with pytest.raises(edgeinfer.InvalidRequestError, match="threads"):
        edgeinfer.load(path, threads=-2)
    with pytest.raises(ModelLoadError):
        edgeinfer.load(None)  # type: ignore[arg-type]


@pytest.mark.model
def test_gguf_truncated_to_half_its_size(default_gguf: Path, tmp_path: Path) -> None:
    half = tmp_path / "half.gguf"
    with default_gguf.open("rb") as src, half.open("wb") as dst:
        dst.write(src.read(default_gguf.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match="truncated"):
        edgeinfer.load(half)


@pytest.mark.model
def test_engine_rejection_is_a_model_load_error(default_gguf: Path, tmp_path: Path) -> None:
    """A well-formed GGUF whose tensors llama.cpp cannot use: mapped, no crash."""
    path = write_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ModelLoadError, match=r"llama\.cpp could not load"):
        edgeinfer.load(path)


@pytest.mark.model
def test_catalog_name_loads_from_the_cache(default_gguf: Path) -> None:
    # the fixture filled the cache; loading by name must use it as it is
    # engine="llama.cpp": the file itself (on the CPU the catalog name runs its transcode)
    with edgeinfer.load("smollm2-135m-instruct", context_length=256, engine="llama.cpp") as model:
        assert model.info["path"] == str(default_gguf)
        assert model.info["format"] == "gguf" and model.context_length == 256
