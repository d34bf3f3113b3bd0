"""apps/desktop_chat.py for real, in a virtual X display (Xvfb): load, type a question, press
Send, see text stream in, press Stop, take a screenshot; a missing model shows in the window.
The picker offers chat models only: an embedding model typed or opened is refused in the
window with Send kept grey (a catalog name before anything is fetched; a folder opened by its
path once it has loaded, and the model is freed).

Every window test is in this one module, under one Xvfb: Tk keeps its connection to a display
after its windows are gone, and an X server that dies under it makes Xlib end the process
(its I/O error handler exits), so a second display per module would end the test run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import edgeinfer
from edgeinfer.files import catalog

from .bertgen import make_bert_folder
from .leakcheck import end_process

APPS = Path(__file__).resolve().parents[1] / "apps"


@pytest.fixture(scope="module")
def display() -> Iterator[str]:
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb); .ci/run installs it")
    pytest.importorskip("tkinter")
    number = 90 + os.getpid() % 50
    name = f":{number}"
    server = subprocess.Popen(
        ["Xvfb", name, "-screen", "0", "1024x768x24", "-nolisten", "tcp"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    old = os.environ.get("DISPLAY")
    try:
        deadline = time.monotonic() + 20
        while not Path(f"/tmp/.X11-unix/X{number}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.environ["DISPLAY"] = name
        yield name
    finally:
        if old is None:
            os.environ.pop("DISPLAY", None)
        else:
            os.environ["DISPLAY"] = old
        end_process(server, terminate_within=10)  # SIGTERM: Xvfb removes its lock and socket


def _window(model: str, tall_lines: bool = False, **load: object) -> tuple[object, object]:
    import tkinter as tk
    from tkinter import font

    sys.path.insert(0, str(APPS))
    try:
        from desktop_chat import ChatWindow
    finally:
        sys.path.pop(0)
    root = tk.Tk()
    if tall_lines:  # as with Noto Sans Mono on many desktops: 20 px lines and more
        for name in ("TkFixedFont", "TkDefaultFont", "TkTextFont"):
            named = font.nametofont(name, root=root)
            while named.metrics("linespace") < 24:
                named.configure(size=abs(int(named.cget("size"))) + 1)
    return root, ChatWindow(root, model, **load)


def _shown_whole(root: object, widget: object) -> bool:
    """Mapped, given its height, and inside the window's area."""
    w: Any = widget
    r: Any = root
    bottom = w.winfo_rooty() + w.winfo_height()
    needed = w.winfo_reqheight()
    return bool(
        w.winfo_ismapped() and w.winfo_height() >= needed
        and bottom <= r.winfo_rooty() + r.winfo_height()
    )  # fmt: skip


def _pump(root: object, until: Callable[[], bool], timeout: float = 120) -> float:
    """Run the window's event loop until ``until()``; the longest gap between two passes."""
    deadline = time.monotonic() + timeout
    longest, last = 0.0, time.monotonic()
    while not until():
        assert time.monotonic() < deadline, "timed out waiting for the window"
        root.update()  # type: ignore[attr-defined]
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        time.sleep(0.01)
    return longest


@pytest.mark.model
def test_send_stream_stop_and_screenshot(display: str, default_gguf: Path, tmp_path: Path) -> None:
    root, app = _window(str(default_gguf), threads=2, context_length=1024)
    freeze = _pump(root, lambda: "context" in app.status.get())  # type: ignore[attr-defined]
    assert freeze < 0.5  # the window kept answering while the model loaded
    app.entry.insert(0, "Tell me about the history of Paris.")  # type: ignore[attr-defined]
    app.send_button.invoke()  # type: ignore[attr-defined]
    _pump(root, lambda: len(app.transcript().split("Model: ", 1)[-1].strip()) > 20)  # type: ignore[attr-defined]
    app.stop_button.invoke()  # type: ignore[attr-defined]
    _pump(root, lambda: "tok/s" in app.status.get())  # type: ignore[attr-defined]
    assert app.status.get().endswith("(stopped)")  # type: ignore[attr-defined]
    assert "You: Tell me about the history of Paris." in app.transcript()  # type: ignore[attr-defined]
    root.update()  # type: ignore[attr-defined]
    from PIL import ImageGrab

    shot = ImageGrab.grab(xdisplay=display)
    target = Path(os.environ.get("EDGEINFER_SCREENSHOT", tmp_path / "desktop-chat.png"))
    shot.crop((0, 0, 720, 480)).save(target)
    colors = shot.crop((0, 0, 720, 480)).convert("L").getextrema()
    assert colors[1] - colors[0] > 100  # text on the window, not a blank screen
    app.close()  # type: ignore[attr-defined]
    assert app.model is None  # type: ignore[attr-defined]


def test_a_missing_model_is_shown_in_the_window(display: str, tmp_path: Path) -> None:
    root, app = _window(str(tmp_path / "missing.gguf"))
    _pump(root, lambda: "cannot load" in app.status.get(), timeout=30)  # type: ignore[attr-defined]
    assert "no such file" in app.transcript()  # type: ignore[attr-defined]
    assert str(app.send_button["state"]) == "disabled"  # type: ignore[attr-defined]
    app.close()  # type: ignore[attr-defined]


def test_the_status_line_shows_under_a_font_with_tall_lines(display: str, tmp_path: Path) -> None:
    """Every row but the transcript keeps its height; the status line says why Send is grey."""
    root, app = _window(str(tmp_path / "missing.gguf"), tall_lines=True)
    _pump(root, lambda: "cannot load" in app.status.get(), timeout=30)  # type: ignore[attr-defined]
    root.update()  # type: ignore[attr-defined]
    assert _shown_whole(root, app.status_label)  # type: ignore[attr-defined]
    assert _shown_whole(root, app.send_button)  # type: ignore[attr-defined]
    root.geometry("480x240")  # type: ignore[attr-defined]  # the minimum size
    _pump(root, lambda: root.winfo_height() <= 240, timeout=10)  # type: ignore[attr-defined]
    root.update()  # type: ignore[attr-defined]
    assert _shown_whole(root, app.status_label)  # type: ignore[attr-defined]
    app.close()  # type: ignore[attr-defined]


def _replies_done(app: Any) -> list[Any]:
    """The results the worker handed to the window after it stopped polling."""
    done = []
    while not app.events.empty():
        kind, value = app.events.get_nowait()
        if kind == "done":
            done.append(value)
    return done


@pytest.mark.model
def test_closing_the_window_mid_reply_cancels_it_and_frees_the_model(
    display: str, default_gguf: Path
) -> None:
    root, app = _window(str(default_gguf), threads=2, context_length=1024)
    _pump(root, lambda: "context" in app.status.get())  # type: ignore[attr-defined]
    app.entry.insert(0, "Tell me about the history of Paris.")  # type: ignore[attr-defined]
    app.send_button.invoke()  # type: ignore[attr-defined]
    _pump(root, lambda: len(app.transcript().split("Model: ", 1)[-1].strip()) > 20)  # type: ignore[attr-defined]
    close = root.protocol("WM_DELETE_WINDOW")  # type: ignore[attr-defined]  # the window's X
    root.tk.call(close)  # type: ignore[attr-defined]
    assert app.model is None and not app.worker.is_alive()  # type: ignore[attr-defined]
    (result,) = _replies_done(app)
    assert result.finish_reason == "cancelled"


@pytest.mark.model
def test_a_budget_too_small_is_shown_in_the_window(display: str, default_gguf: Path) -> None:
    root, app = _window(str(default_gguf), tall_lines=True, memory_budget="60MB")
    _pump(root, lambda: "cannot load" in app.status.get(), timeout=60)  # type: ignore[attr-defined]
    root.update()  # type: ignore[attr-defined]
    assert "budget" in app.status.get().lower()  # type: ignore[attr-defined]
    assert "budget" in app.transcript().lower()  # type: ignore[attr-defined]
    assert _shown_whole(root, app.status_label)  # type: ignore[attr-defined]
    assert str(app.send_button["state"]) == "disabled"  # type: ignore[attr-defined]
    app.close()  # type: ignore[attr-defined]


def test_the_picker_offers_the_chat_models_only(display: str, tmp_path: Path) -> None:
    root, app = _window(str(tmp_path / "missing.gguf"))
    _pump(root, lambda: "cannot load" in app.status.get(), timeout=30)  # type: ignore[attr-defined]
    offered = list(app.picker.cget("values"))  # type: ignore[attr-defined]
    assert catalog.DEFAULT_MODEL in offered
    assert offered == [n for n, e in catalog.CATALOG.items() if e.kind == "generation"]
    embedding = [n for n, e in catalog.CATALOG.items() if e.kind == "embedding"]
    assert embedding and not set(embedding) & set(offered)
    app.close()  # type: ignore[attr-defined]


def test_an_embedding_model_typed_by_name_is_refused_before_any_fetch(
    display: str,
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
    display: str,
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
