"""apps/desktop_chat.py offers chat models only: the picker lists the catalog's generation
models, and an embedding model typed or opened is refused in the window with Send kept grey
(a catalog name before anything is fetched; a folder opened by its path once it has loaded,
and the model is freed). Real windows in a virtual X display (Xvfb)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import edgeinfer
from edgeinfer import catalog

from .bertgen import make_bert_folder
from .test_desktop_app import _pump, _window, display  # noqa: F401  (display: a fixture)


def test_the_picker_offers_the_chat_models_only(display: str, tmp_path: Path) -> None:  # noqa: F811
    root, app = _window(str(tmp_path / "missing.gguf"))
    _pump(root, lambda: "cannot load" in app.status.get(), timeout=30)  # type: ignore[attr-defined]
    offered = list(app.picker.cget("values"))  # type: ignore[attr-defined]
    assert catalog.DEFAULT_MODEL in offered
    assert offered == [n for n, e in catalog.CATALOG.items() if e.kind == "generation"]
    embedding = [n for n, e in catalog.CATALOG.items() if e.kind == "embedding"]
    assert embedding and not set(embedding) & set(offered)
    app.close()  # type: ignore[attr-defined]


def test_an_embedding_model_typed_by_name_is_refused_before_any_fetch(
    display: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[Any] = []
    monkeypatch.setattr(edgeinfer, "load", lambda name, **kw: asked.append(name))
    monkeypatch.setattr(catalog, "fetch", lambda *a, **kw: asked.append(a))
    name = next(n for n, e in catalog.CATALOG.items() if e.kind == "embedding")
    root, app = _window(name)
    _pump(root, lambda: "cannot load" in app.status.get(), timeout=30)  # type: ignore[attr-defined]
    status = app.status.get()  # type: ignore[attr-defined]
    assert f"{name} is an embedding model" in status and "pick a chat model" in status
    assert "embedding model" in app.transcript()  # type: ignore[attr-defined]
    assert str(app.send_button["state"]) == "disabled"  # type: ignore[attr-defined]
    assert app.model is None and asked == []  # type: ignore[attr-defined]
    app.close()  # type: ignore[attr-defined]


def test_an_embedding_folder_opened_by_path_is_refused_and_freed(
    display: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    folder = make_bert_folder(tmp_path / "bert", seed=3)
    loaded: list[Any] = []
    real_load = edgeinfer.load

    def load(name: str, **options: Any) -> Any:
        loaded.append(real_load(name, **options))
        return loaded[-1]

    monkeypatch.setattr(edgeinfer, "load", load)
    root, app = _window(str(folder), threads=1)
    _pump(root, lambda: "cannot load" in app.status.get(), timeout=300)  # type: ignore[attr-defined]
    assert "is an embedding model" in app.status.get()  # type: ignore[attr-defined]
    assert str(app.send_button["state"]) == "disabled"  # type: ignore[attr-defined]
    app.entry.insert(0, "hello")  # type: ignore[attr-defined]
    app.send()  # type: ignore[attr-defined]  # Send pressed anyway: nothing happens
    assert "You: hello" not in app.transcript()  # type: ignore[attr-defined]
    (model,) = loaded
    assert app.model is None and "closed" in repr(model)  # type: ignore[attr-defined]
    app.close()  # type: ignore[attr-defined]
