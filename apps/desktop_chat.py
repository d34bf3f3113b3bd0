"""A desktop chat window on edgeinfer's public API, with Tkinter (the standard library).

The model loads and replies in a worker thread; its tokens reach the window through a queue
that the window polls with ``after()``, so the window never freezes. Stop cancels the reply
within a token; closing the window mid-reply cancels it and frees the model. The picker lists
the catalog's chat models only; an embedding model typed or opened is refused in the window
(a catalog name before anything is fetched, a file or folder once it has loaded).

    python apps/desktop_chat.py [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import queue
import threading
import tkinter as tk
from pathlib import Path
from tkinter import filedialog, ttk
from typing import Any

import edgeinfer
from edgeinfer.files import catalog

POLL_MS = 30
_NOT_CHAT = (
    "{name} is an embedding model: it makes vectors, not replies, and this window chats; "
    "pick a chat model from the list (embed texts with `edgeinfer embed {name} TEXT`)"
)
MIN_WIDTH, MIN_HEIGHT = 480, 240  # px: every fixed row and a few transcript lines


class ChatWindow:
    def __init__(self, root: tk.Tk, model_name: str, **load: Any) -> None:
        self.root = root
        self.load_options = load
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.model: Any = None
        self.stream: Any = None
        self.worker: threading.Thread | None = None
        self.messages: list[dict[str, str]] = []
        self.closing = False

        root.title("edgeinfer chat")
        root.geometry("720x480")
        root.minsize(MIN_WIDTH, MIN_HEIGHT)
        # a grid: the model row, the input row and the status line keep their height; only
        # the transcript (weight 1) gives way when the window or its fonts leave too little
        root.columnconfigure(0, weight=1)
        root.rowconfigure(1, weight=1)
        top = ttk.Frame(root, padding=6)
        top.grid(row=0, column=0, sticky="ew")
        ttk.Label(top, text="Model:").pack(side="left")
        self.model_var = tk.StringVar(value=model_name)
        self.picker = ttk.Combobox(top, textvariable=self.model_var, values=chat_models(), width=40)
        self.picker.pack(side="left", padx=4)
        self.picker.bind("<<ComboboxSelected>>", lambda _e: self.load_model())
        ttk.Button(top, text="Open…", command=self.open_file).pack(side="left")
        ttk.Button(top, text="Load", command=self.load_model).pack(side="left", padx=4)

        # height in lines is only what the window asks for; the grid sizes it to what is left
        self.log = tk.Text(root, wrap="word", state="disabled", height=8)
        self.log.grid(row=1, column=0, sticky="nsew", padx=6)
        self.log.tag_configure("user", foreground="#1a4f8b")
        self.log.tag_configure("note", foreground="#8b1a1a")

        bottom = ttk.Frame(root, padding=6)
        bottom.grid(row=2, column=0, sticky="ew")
        self.entry = ttk.Entry(bottom)
        self.entry.pack(side="left", fill="x", expand=True)
        self.entry.bind("<Return>", lambda _e: self.send())
        self.send_button = ttk.Button(bottom, text="Send", command=self.send)
        self.send_button.pack(side="left", padx=4)
        self.stop_button = ttk.Button(bottom, text="Stop", command=self.stop, state="disabled")
        self.stop_button.pack(side="left")
        self.status = tk.StringVar(value="")
        self.status_label = ttk.Label(
            root, textvariable=self.status, anchor="w", padding=(6, 0, 6, 4)
        )
        self.status_label.grid(row=3, column=0, sticky="ew")

        root.protocol("WM_DELETE_WINDOW", self.close)
        root.after(POLL_MS, self.poll)
        self.load_model()

    # -- the worker ------------------------------------------------------------------------

    def _start(self, target: Any, *args: Any) -> None:
        self.worker = threading.Thread(target=target, args=args, daemon=True)
        self.worker.start()

    def load_model(self) -> None:
        if self.worker is not None and self.worker.is_alive():
            return
        name = self.model_var.get().strip()
        self.status.set(f"loading {name}…")
        self.send_button.configure(state="disabled")
        self._start(self._load, name)

    def _load(self, name: str) -> None:
        try:
            if self.model is not None:
                self.model.close()
                self.model = None
            if _catalog_kind(name) == "embedding":  # refused before anything is fetched
                self.events.put(("error", f"cannot load {name}: {_NOT_CHAT.format(name=name)}"))
                return
            model = edgeinfer.load(name, **self.load_options)
            if model.info.get("kind") == "embedding":  # a file or folder opened by its path
                model.close()
                self.events.put(("error", f"cannot load {name}: {_NOT_CHAT.format(name=name)}"))
                return
            self.events.put(("loaded", model))
        except Exception as exc:  # shown in the window: a missing model, a budget too small
            self.events.put(("error", f"cannot load {name}: {exc}"))

    def send(self) -> None:
        text = self.entry.get().strip()
        if not text or self.model is None or (self.worker and self.worker.is_alive()):
            return
        self.entry.delete(0, "end")
        self.messages.append({"role": "user", "content": text})
        self._write(f"You: {text}\n", "user")
        self._write("Model: ")
        self.send_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        self._start(self._reply, list(self.messages))

    def _reply(self, messages: list[dict[str, str]]) -> None:
        try:
            if self.model.chat_template is None:
                self.stream = self.model.stream(messages[-1]["content"], max_new_tokens=512)
            else:
                self.stream = self.model.chat(messages, stream=True, max_new_tokens=512)
            for chunk in self.stream:
                if chunk.text:
                    self.events.put(("text", chunk.text))
            self.events.put(("done", self.stream.result))
        except Exception as exc:
            self.events.put(("error", f"the reply failed: {exc}"))
        finally:
            self.stream = None

    def stop(self) -> None:
        stream = self.stream
        if stream is not None:
            stream.cancel()  # the worker's loop ends at its next token

    def close(self) -> None:
        """Closing mid-reply: cancel it, wait for the worker, free the model."""
        self.closing = True
        self.stop()
        if self.worker is not None:
            self.worker.join(timeout=10)
        if self.model is not None:
            self.model.close()
            self.model = None
        self.root.destroy()

    def open_file(self) -> None:
        path = filedialog.askopenfilename(
            title="A .gguf model (or cancel and pick a folder)",
            filetypes=[("GGUF models", "*.gguf"), ("All files", "*")],
        ) or filedialog.askdirectory(title="An ONNX model folder")
        if path:
            self.model_var.set(path)
            self.load_model()

    # -- the window's side -----------------------------------------------------------------

    def poll(self) -> None:
        if self.closing:
            return
        try:
            while True:
                kind, value = self.events.get_nowait()
                self._on_event(kind, value)
        except queue.Empty:
            pass
        self.root.after(POLL_MS, self.poll)

    def _on_event(self, kind: str, value: Any) -> None:
        if kind == "loaded":
            self.model = value
            info = value.info
            self.status.set(
                f"{self.model_var.get()} on {info.get('provider')}, context {value.context_length}"
            )
            self.send_button.configure(state="normal")
        elif kind == "text":
            self._write(value)
        elif kind == "done":
            self._write("\n\n")
            self.messages.append({"role": "assistant", "content": value.text})
            s = value.stats
            stopped = " (stopped)" if value.finish_reason == "cancelled" else ""
            self.status.set(
                f"{self.model.info.get('provider')}, context {self.model.context_length} | "
                f"{s.completion_tokens} tokens, {s.decode_tokens_per_s:.1f} tok/s, peak RSS "
                f"{s.peak_rss_bytes / 2**20:.0f} MiB{stopped}"
            )
            self._idle()
        elif kind == "error":
            self._write(f"\n[{value}]\n\n", "note")
            self.status.set(value)
            self._idle()

    def _idle(self) -> None:
        self.send_button.configure(state="normal" if self.model is not None else "disabled")
        self.stop_button.configure(state="disabled")

    def _write(self, text: str, tag: str | None = None) -> None:
        self.log.configure(state="normal")
        self.log.insert("end", text, tag or ())
        self.log.see("end")
        self.log.configure(state="disabled")

    def transcript(self) -> str:
        return self.log.get("1.0", "end")


def chat_models() -> list[str]:
    """The catalog's names that chat (text generation), for the picker."""
    return [name for name, entry in catalog.CATALOG.items() if entry.kind == "generation"]


def _catalog_kind(name: str) -> str | None:
    """The catalog kind of ``name`` ("generation", "embedding"); None for a path (a file or
    folder of that name is loaded as such, as ``load()`` does)."""
    entry = catalog.lookup(name)
    if entry is None or Path(name).expanduser().exists():
        return None
    return entry.kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=catalog.DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    root = tk.Tk()
    ChatWindow(root, args.model, threads=args.threads)
    root.mainloop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
