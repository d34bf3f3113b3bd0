from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer import catalog
from edgeinfer.model import Model

from .fakes import FakeBackend


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
