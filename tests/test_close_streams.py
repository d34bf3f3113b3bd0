"""Model.close() beside open streams at parallel=1: it ends them ("cancelled") and returns
without waiting for a consumer that holds a chunk; the engine is never touched once freed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from edgeinfer import EdgeInferError
from edgeinfer.generation.results import Chunk
from edgeinfer.model import Model

from .fakes import FakeBackend

PROMPT_WAIT_S = 60.0  # how long a helper thread waits for its cue before the test fails


class Watched(FakeBackend):
    """Records every engine call made after ``close()``; ``gate``, when set, holds the next
    decode until released (a step in progress)."""

    def __init__(self) -> None:
        super().__init__(eos_boost=-100.0)  # never ends on its own
        self.after_close: list[str] = []
        self.gate: threading.Event | None = None
        self.in_decode = threading.Event()

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        if self.closed:
            self.after_close.append("prefill")
        return super().prefill(token_ids)

    def decode(self, token_id: int) -> np.ndarray:
        if self.closed:
            self.after_close.append("decode")
        if self.gate is not None:
            self.in_decode.set()
            self.gate.wait(PROMPT_WAIT_S)
        return super().decode(token_id)

    def rewind(self, n: int) -> None:
        if self.closed:
            self.after_close.append("rewind")
        super().rewind(n)


def _model() -> tuple[Model, Watched]:
    backend = Watched()
    return Model(backend, name="fake", path=Path("fake"), model_format="fake"), backend


def _close_in_thread(model: Model) -> threading.Thread:
    closer = threading.Thread(target=model.close, daemon=True)
    closer.start()
    return closer


def test_close_beside_a_suspended_stream_returns_and_ends_it_cancelled() -> None:
    """Another thread holds a stream after its first chunk and does not come back until
    close() has returned: close() neither waits for it nor frees the engine under it."""
    model, backend = _model()
    took_first, go_on = threading.Event(), threading.Event()
    chunks: list[Chunk] = []

    def consumer() -> None:
        stream = model.stream("hello", max_new_tokens=200, temperature=0)
        chunks.append(next(stream))
        took_first.set()
        go_on.wait(PROMPT_WAIT_S)
        chunks.extend(stream)

    thread = threading.Thread(target=consumer, daemon=True)
    thread.start()
    assert took_first.wait(PROMPT_WAIT_S)
    closer = _close_in_thread(model)
    closer.join(PROMPT_WAIT_S)
    assert not closer.is_alive(), "close() waited for the stream another thread holds"
    assert backend.closed
    go_on.set()
    thread.join(PROMPT_WAIT_S)
    assert not thread.is_alive()
    assert chunks[-1].finish_reason == "cancelled" and chunks[-1].stats is not None
    assert len(chunks) == 2  # the first chunk, then the end: nothing generated after close()
    assert backend.after_close == []
    with pytest.raises(EdgeInferError, match="closed"):
        model.generate("again", max_new_tokens=2)


def test_close_waits_for_a_step_in_progress_never_frees_under_it() -> None:
    """A decode running in another thread when close() is called: close() returns once that
    step is done (the engine is freed after it, not during it); the stream ends cancelled."""
    model, backend = _model()
    stream = model.stream("hello", max_new_tokens=200, temperature=0)
    first = next(stream)
    backend.gate = threading.Event()
    rest: list[Chunk] = []
    thread = threading.Thread(target=lambda: rest.extend(stream), daemon=True)
    thread.start()
    assert backend.in_decode.wait(PROMPT_WAIT_S)
    closer = _close_in_thread(model)
    time.sleep(0.2)  # close() is now waiting for the step (a quicker close() fails below)
    assert not backend.closed, "the engine was freed while a decode was running"
    backend.gate.set()
    closer.join(PROMPT_WAIT_S)
    thread.join(PROMPT_WAIT_S)
    assert not closer.is_alive() and not thread.is_alive()
    assert backend.closed and backend.after_close == []
    assert first.finish_reason is None and rest[-1].finish_reason == "cancelled"


def test_a_waiting_request_behind_a_closed_stream_is_refused() -> None:
    """A request queued behind the suspended stream gets its turn once that stream ends, and
    is refused (the model is closed) without touching the engine."""
    model, backend = _model()
    stream = model.stream("hello", max_new_tokens=200, temperature=0)
    next(stream)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            model.generate("queued", max_new_tokens=2)
        except BaseException as exc:  # the test reads it
            errors.append(exc)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    deadline = time.monotonic() + PROMPT_WAIT_S
    while model.activity["queued"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    model.close()
    assert [c.finish_reason for c in stream][-1] == "cancelled"
    thread.join(PROMPT_WAIT_S)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EdgeInferError)
    assert "closed" in str(errors[0]) and backend.after_close == []


def test_close_from_the_consumers_own_thread() -> None:
    """close() in the thread that holds an unfinished stream: the stream ends cancelled."""
    model, backend = _model()
    stream = model.stream("hello", max_new_tokens=200, temperature=0)
    next(stream)
    model.close()
    assert [c.finish_reason for c in stream] == ["cancelled"]
    assert backend.closed and backend.after_close == []


@pytest.mark.parametrize("fixture", ["tiny_llama_gguf", "tiny_native_onnx"])
def test_close_beside_a_suspended_stream_on_a_real_engine(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """The same on llama.cpp and ONNX Runtime, in a child process (a freed engine touched
    again is a segmentation fault, not an exception): close() returns at once, the stream
    then ends cancelled, the process exits 0."""
    path = request.getfixturevalue(fixture)
    script = textwrap.dedent(
        f"""
        import signal, threading, time
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import edgeinfer
        m = edgeinfer.load({str(path)!r}, context_length=256, threads=1)
        tok = m._backend.tokenizer
        bias = {{t: -100.0 for t in range(tok.n_vocab) if tok.is_end_of_generation(t)}}
        s = m.stream("word " * 20, max_new_tokens=150, temperature=0, logit_bias=bias)
        first, go = threading.Event(), threading.Event()
        out = []
        def consume():
            out.append(next(s)); first.set(); go.wait(120); out.extend(s)
        t = threading.Thread(target=consume); t.start(); first.wait(120)
        t0 = time.monotonic(); m.close(); took = time.monotonic() - t0
        go.set(); t.join(120)
        print("CLOSED", round(took, 3), out[-1].finish_reason, len(out))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    _, took, finish, count = done.stdout.split()[-4:]
    assert finish == "cancelled" and int(count) == 2
    assert float(took) < 10.0  # it waited 20 s and more for the consumer before


@pytest.fixture(scope="module")
def tiny_native_onnx(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    folder = tmp_path_factory.mktemp("tiny-native-close") / "native"
    folder.mkdir()
    write_gguf_folder(tiny_llama_gguf, folder, max_context=256)
    return folder
