"""`edgeinfer serve --parallel N`: several requests generated at once, the rest queued.

Three layers. The server's queue (``Admission``) against a model of itself, driven by
hypothesis. The real server code (uvicorn, the ASGI app, the CLI's stop path) in this process
over a real ``Model`` whose engine steps a fake slot backend (fast, and exact by construction,
so a reply in a batch must equal the reply alone). And the real ``edgeinfer serve --parallel
N`` process on the tiny GGUF model, driven by the official ``openai`` client and raw sockets:
concurrent streams, cancelling one, /health, 503 past the queue, SIGTERM with N streams
running, and connections that open and drop or send their bodies slowly while N stream.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import edgeinfer

hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("llama_cpp")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgeinfer.model import Model  # noqa: E402
from edgeinfer.serve.admission import Admission  # noqa: E402

from .fakes import EOS, FakeSlotBackend  # noqa: E402
from .test_serve import KEY, Server, _free_port, _start  # noqa: E402


def cases(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def _wait_for(condition: Callable[[], Any], timeout: float = 60, what: str = "") -> Any:
    """Poll ``condition`` until it is true (a state to reach, not a timing to assert)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or condition}")
        time.sleep(0.02)


# -- the queue against a model of itself ---------------------------------------------------------


@dataclass(eq=False)
class _Stub:
    """What ``Admission`` reads of a job."""

    why: str | None = None
    started: bool = False

    @property
    def cancelled(self) -> bool:
        return self.why is not None

    def cancel(self, why: str) -> None:
        self.why = self.why or why


ops = st.lists(
    st.tuples(st.sampled_from(["enter", "leave", "cancel"]), st.integers(0, 30)), max_size=60
)


@cases(300)
@given(slots=st.integers(1, 6), max_queue=st.integers(0, 5), script=ops)
def test_the_first_slots_admitted_run_the_rest_wait_in_order(
    slots: int, max_queue: int, script: list[tuple[str, int]]
) -> None:
    admission = Admission(max_queue, slots=slots)
    line: list[_Stub] = []  # the model: admitted jobs in arrival order
    for op, n in script:
        if op == "enter":
            job = _Stub()
            admitted = admission.enter(job)  # type: ignore[arg-type]
            assert admitted == (len(line) < slots + max_queue)
            if admitted:
                line.append(job)
        elif line and op == "leave":
            job = line.pop(n % len(line))
            admission.leave(job)  # type: ignore[arg-type]
        elif line and op == "cancel":
            job = line[n % len(line)]
            job.cancel("client")
            assert admission.wait_turn(job) is False  # a cancelled job never gets a turn
        assert admission.running == min(len(line), slots)
        assert admission.waiting == max(0, len(line) - slots)
        assert admission.busy == bool(line)
        for i, job in enumerate(line):
            assert admission._holds_slot(job) == (i < slots)  # type: ignore[arg-type]
            if i < slots and not job.cancelled:
                assert admission.wait_turn(job) is True  # type: ignore[arg-type]


def test_waiting_jobs_get_freed_slots_first_come() -> None:
    admission = Admission(max_queue=4, slots=2)
    jobs = [_Stub() for _ in range(6)]
    assert [admission.enter(j) for j in jobs] == [True] * 6  # type: ignore[arg-type]
    assert admission.enter(_Stub()) is False  # type: ignore[arg-type]
    order: list[int] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        if admission.wait_turn(jobs[i]):  # type: ignore[arg-type]
            with lock:
                order.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in (5, 4, 3, 2)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert order == []  # jobs 0 and 1 hold both slots
    admission.leave(jobs[1])  # type: ignore[arg-type]
    _wait_for(lambda: order == [2], what="job 2 to get the freed slot")
    jobs[4].cancel("client")  # a waiting job whose client left: its thread leaves the line
    admission.wake()
    admission.leave(jobs[4])  # type: ignore[arg-type]
    admission.leave(jobs[0])  # type: ignore[arg-type]
    _wait_for(lambda: order == [2, 3], what="job 3 next")
    admission.leave(jobs[2])  # type: ignore[arg-type]
    _wait_for(lambda: order == [2, 3, 5], what="job 5 after the cancelled 4")
    for t in threads:
        t.join(10)
    assert admission.running == 2 and admission.waiting == 0  # 3 and 5
    assert admission.shutdown() == (0, 2)  # none of the stubs started


# -- the real server code in this process, over the real engine and a fake slot backend ----------


class GatedSlots(FakeSlotBackend):
    """A fake slot backend whose forward passes wait while ``gate`` is clear."""

    def __init__(self, n_slots: int) -> None:
        super().__init__(n_slots=n_slots, n_ctx=256)
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.002  # a slow engine: streams overlap

    def decode_many(self, steps: Any) -> Any:
        while not self.gate.wait(0.05):
            pass
        return super().decode_many(steps)


@dataclass
class Live:
    url: str
    model: Model
    backend: GatedSlots
    log: list[str] = field(default_factory=list)

    def lines(self, pattern: str) -> list[str]:
        return [line for line in list(self.log) if re.search(pattern, line)]

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=30).json()


class _ListHandler(logging.Handler):
    def __init__(self, out: list[str]) -> None:
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(record.getMessage())


@contextmanager
def serving(slots: int, max_queue: int = 2) -> Iterator[Live]:
    """The server the ``serve`` command runs (its uvicorn subclass and stop path), in a
    thread of this process, over a model with ``slots`` slots and a sliding context (so a
    reply with EOS banned never ends on its own)."""
    from edgeinfer.cli.serve import _server
    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    backend = GatedSlots(slots)
    model = Model(
        backend, name="fake", path=Path("fake"), model_format="fake", context_overflow="slide"
    )
    assert model.parallel == slots
    live = Live("", model, backend)
    access = logging.getLogger("edgeinfer.serve.access")
    handler, level = _ListHandler(live.log), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    port = _free_port()
    app = create_app(model, ServerConfig(name="fake", max_queue=max_queue))
    server = _server(uvicorn, app, "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    live.url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: server.started or not thread.is_alive(), what="the server to start")
        assert thread.is_alive()
        yield live
    finally:
        backend.gate.set()
        server.should_exit = True  # what the CLI's SIGTERM handler does
        thread.join(60)
        assert app.state.wait_idle(30)
        model.close()
        access.removeHandler(handler)
        access.setLevel(level)
    assert not thread.is_alive()
    assert not [line for line in live.log if "Traceback" in line]


FAKE_BAN = {str(EOS): -100}
FAKE_ENDLESS = {"max_tokens": 10**6, "logit_bias": FAKE_BAN}


def _sse(url: str, body: dict[str, Any], **headers: str) -> list[Any]:
    """A streamed completion's events: JSON objects, then "[DONE]"."""
    events: list[Any] = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _text_and_usage(events: list[Any]) -> tuple[str, str | None, dict[str, Any] | None]:
    """(text, finish reason, usage) of a well-formed stream that ends with [DONE]."""
    assert events and events[-1] == "[DONE]", events[-3:]
    text, finish, usage = "", None, None
    for event in events[:-1]:
        assert "error" not in event, event
        for choice in event["choices"]:
            text += choice["text"]
            finish = choice["finish_reason"] or finish
        usage = event.get("usage") or usage
    return text, finish, usage


def _concurrently(n: int, work: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = work(i)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


PROMPTS = ["Once upon a time", "The capital of France", "def main():", "Lorem ipsum dolor"]


@pytest.mark.parametrize("slots", [2, 4])
def test_concurrent_streams_each_equal_their_reply_alone(slots: int) -> None:
    with serving(slots) as live:
        body = {"temperature": 0, "max_tokens": 16, "logit_bias": FAKE_BAN}
        body |= {"stream_options": {"include_usage": True}}
        alone = [_text_and_usage(_sse(live.url, {**body, "prompt": p})) for p in PROMPTS]
        live.backend.steps.clear()
        live.backend.gate.clear()  # the first stream holds the engine until all are in
        replies = []

        def ask(i: int) -> Any:
            return _text_and_usage(_sse(live.url, {**body, "prompt": PROMPTS[i]}))

        asker = threading.Thread(target=lambda: replies.extend(_concurrently(len(PROMPTS), ask)))
        asker.start()
        _wait_for(lambda: _admitted(live) == len(PROMPTS), what="every request admitted")
        live.backend.gate.set()
        asker.join(120)
        assert replies == alone
        for _, finish, usage in replies:
            assert finish == "length" and usage["completion_tokens"] == 16
        batched = [s for s in live.backend.steps if s[0] == "decode" and len(s[1]) > 1]
        assert max(len(s[1]) for s in batched) == slots  # every slot in one forward pass
        # each request's access line is written once its reply has gone out: wait for it
        done = r"path=/v1/completions stream=True status=200"
        _wait_for(lambda: len(live.lines(done)) == 8, what="8 access lines")


def _admitted(live: Live) -> int:
    activity = live.health()["activity"]
    return int(activity["busy"] + activity["queued"])


def test_health_counts_running_and_waiting_and_503_past_the_queue() -> None:
    with serving(3, max_queue=2) as live:
        assert live.health()["activity"] == {"slots": 3, "busy": 0, "queued": 0}
        stop = threading.Event()

        def endless(i: int) -> int:
            body = {**FAKE_ENDLESS, "prompt": PROMPTS[i % 4], "stream": True}
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break
            return r.status_code

        runner = threading.Thread(target=lambda: _concurrently(5, endless))
        runner.start()
        want = {"slots": 3, "busy": 3, "queued": 2}
        _wait_for(lambda: live.health()["activity"] == want, what=f"activity {want}")
        health = live.health()
        assert health["queue"] == 2 and health["busy"] is True
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"].isdigit()
        assert r.json()["error"]["code"] == "server_busy"
        stop.set()  # every client hangs up: the running ones are cancelled, the waiting dropped
        runner.join(60)
        _wait_for(
            lambda: live.health()["activity"] == {"slots": 3, "busy": 0, "queued": 0},
            what="every slot free",
        )
        _wait_for(lambda: len(live.lines("status=499")) == 5, what="five 499 lines")


def test_a_client_that_leaves_frees_its_slot_and_the_others_finish() -> None:
    with serving(3, max_queue=0) as live:
        body = {"temperature": 0, "max_tokens": 40, "logit_bias": FAKE_BAN}
        alone = [_text_and_usage(_sse(live.url, {**body, "prompt": p}))[0] for p in PROMPTS[:2]]
        got: list[Any] = [None, None]
        running = threading.Barrier(2)

        def finish(i: int) -> None:
            got[i] = _text_and_usage(_sse(live.url, {**body, "prompt": PROMPTS[i]}))[0]

        def leave() -> None:
            stream_body = {**FAKE_ENDLESS, "prompt": "Leaving soon", "stream": True}
            with httpx.stream(
                "POST", f"{live.url}/v1/completions", json=stream_body, timeout=60
            ) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                running.wait(30)
            # closed here, mid-stream

        live.backend.gate.clear()
        leaver = threading.Thread(target=leave)
        leaver.start()
        _wait_for(lambda: live.health()["activity"]["busy"] == 1, what="the leaver running")
        finishers = [threading.Thread(target=finish, args=(i,)) for i in range(2)]
        for t in finishers:
            t.start()
        _wait_for(lambda: _admitted(live) == 3, what="two more admitted")
        live.backend.gate.set()
        running.wait(30)
        leaver.join(30)
        for t in finishers:
            t.join(60)
        assert got == alone
        (line,) = _wait_for(lambda: live.lines("status=499"), what="the leaver's 499")
        assert "finish_reason=cancelled" in line
        # its slot is free again: a fourth request gets one (max-queue 0 would refuse a wait)
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200


def test_stopping_with_n_streams_ends_each_and_refuses_the_waiting() -> None:
    events: list[list[Any]] = [[] for _ in range(3)]
    waiting: list[httpx.Response] = []
    with serving(3, max_queue=1) as live:

        def stream(i: int) -> None:
            body = {**FAKE_ENDLESS, "prompt": PROMPTS[i], "stream": True}
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events[i].append(data if data == "[DONE]" else json.loads(data))

        streams = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in streams:
            t.start()
        _wait_for(lambda: all(len(e) >= 3 for e in events), what="three streams running")
        waiter = threading.Thread(
            target=lambda: waiting.append(
                httpx.post(
                    f"{live.url}/v1/completions", json={**FAKE_ENDLESS, "prompt": "x"}, timeout=60
                )
            )
        )
        waiter.start()
        _wait_for(lambda: live.health()["queue"] == 1, what="one request waiting")
    # the server stopped the way SIGTERM stops it (the serve command's Server.shutdown)
    for t in [*streams, waiter]:
        t.join(30)
    for e in events:
        text, finish, _ = _text_and_usage(e)
        assert finish == "cancelled" and text
    assert waiting[0].status_code == 503
    assert waiting[0].json()["error"]["code"] == "server_shutting_down"


# -- the real process on the tiny model ----------------------------------------------------------

needs_slots = pytest.mark.skipif(
    "parallel" not in inspect.signature(edgeinfer.load).parameters,
    reason="edgeinfer.load has no parallel= yet",
)
BAN_EOS = {"0": -100, "2": -100}  # both end a reply of the tiny model
ENDLESS = {"max_tokens": 10**6, "logit_bias": BAN_EOS}
SERVE = [sys.executable, "-m", "edgeinfer.cli", "serve"]


@pytest.fixture(scope="module")
def tiny_q4_1(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama quantized to Q4_1, as the default model is: llama.cpp gives each row of
    a batch what it gives alone bit for bit there (tests/test_llama_slots.py)."""
    from edgeinfer.converters.gguf.writer import quantize_gguf

    out = tmp_path_factory.mktemp("serve-q4_1") / "tiny-q4_1.gguf"
    quantize_gguf(tiny_llama_gguf, out, "q4_1", threads=1)
    return out


@pytest.fixture(scope="module")
def parallel3(tiny_q4_1: Path) -> Iterator[Server]:
    args = ["--api-key", KEY, "--parallel", "3", "--max-queue", "1"]
    yield from _start(tiny_q4_1, *args, "--context-overflow", "slide")


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _openai_stream(server: Server, prompt: str, max_tokens: int) -> tuple[str, Any, str]:
    chunks = list(
        server.client().completions.create(  # type: ignore[attr-defined]
            model="default",
            prompt=prompt,
            temperature=0,
            max_tokens=max_tokens,
            logit_bias=BAN_EOS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [], chunks[-1]
    return text, chunks[-1].usage, finals[-1]


@contextmanager
def _running_all_along(server: Server) -> Iterator[list[Any]]:
    """An endless stream that holds a slot and decodes until the block ends: every request
    answered inside the block shares its forward passes. Yields its events (growing)."""
    events: list[Any] = []
    stop = threading.Event()

    def run() -> None:
        body = {**ENDLESS, "prompt": "Lorem ipsum dolor", "stream": True}
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=_headers(), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                if stop.is_set():
                    break

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    _wait_for(lambda: len(events) >= 3, what="the stream running all along")
    try:
        yield events
        seen = len(events)
        _wait_for(lambda: len(events) > seen + 3, what="the stream still running after")
        assert all(e["choices"][0]["finish_reason"] is None for e in events)  # never ended
    finally:
        stop.set()
        thread.join(60)
    _wait_for(lambda: httpx.get(f"{server.url}/health").json()["activity"]["busy"] == 0)


@needs_slots
def test_real_concurrent_clients_get_whole_replies_equal_to_alone(parallel3: Server) -> None:
    """Each prompt alone (one request at a time), then concurrently beside a stream that
    runs all along (so each reply is decoded in a batch): greedy, the same text and usage."""
    health = httpx.get(f"{parallel3.url}/health").json()
    assert health["activity"] == {"slots": 3, "busy": 0, "queued": 0}
    alone = [_openai_stream(parallel3, p, 20) for p in PROMPTS]
    with _running_all_along(parallel3):
        # two free slots and one place in the queue: two run beside it, one waits its turn
        together = _concurrently(3, lambda i: _openai_stream(parallel3, PROMPTS[i], 20))
    assert [t[0] for t in together] == [a[0] for a in alone[:3]]
    many = _concurrently(4, lambda i: _openai_stream(parallel3, PROMPTS[i], 20))  # 3 run, 1 waits
    assert [m[0] for m in many] == [a[0] for a in alone]
    wanted = [*alone[:3], *alone]
    for (text, usage, finish), (_, want, _) in zip([*together, *many], wanted, strict=True):
        assert finish == "length" and text
        assert usage.completion_tokens == 20 and usage.prompt_tokens == want.prompt_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    done = r"path=/v1/completions stream=True status=200 .*completion_tokens=20\b"
    # the access line is written once the reply is sent, so the last one may trail the client
    lines = _wait_for(lambda: len(parallel3.lines(done)) >= 11 and parallel3.lines(done), what="11")
    assert all("ttft_ms=" in line for line in lines)


def _endless_streams(url: str, events: list[list[Any]], *which: int) -> list[threading.Thread]:
    """Streams of endless replies, each event into ``events[i]`` after the status code."""

    def run(i: int) -> None:
        body = {**ENDLESS, "prompt": PROMPTS[i % 4], "stream": True}
        try:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body, headers=_headers(), timeout=60
            ) as r:
                events[i].append(r.status_code)
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events[i].append(data if data == "[DONE]" else json.loads(data))
        except httpx.HTTPError as exc:  # reported by the caller's checks
            events[i].append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in which]
    for t in threads:
        t.start()
    return threads


@needs_slots
def test_real_leaving_client_queue_limit_and_hostile_connections(parallel3: Server) -> None:
    url, port = parallel3.url, int(parallel3.url.rsplit(":", 1)[1])
    events: list[list[Any]] = [[] for _ in range(2)]
    streams = _endless_streams(url, events, 0, 1)
    _wait_for(lambda: all(len(e) >= 3 for e in events), what="two streams running")
    # slowloris: bodies that never finish, and connections that open and drop, while 2 stream
    slow = [_slow_body(port) for _ in range(20)]
    for _ in range(60):
        _open_and_drop(port)
    seen = [len(e) for e in events]
    _wait_for(lambda: all(len(e) > s + 5 for e, s in zip(events, seen, strict=True)))
    # a third stream takes the last slot and leaves early: the other two go on
    before = len(parallel3.lines("status=499"))
    _, usage, finish = _openai_stream(parallel3, "Hello", 5)
    assert finish == "length" and usage.completion_tokens == 5
    leaver: list[list[Any]] = [[]]
    third = _endless_streams(url, leaver, 0)
    _wait_for(lambda: len(leaver[0]) >= 2, what="the third stream")
    health = httpx.get(f"{url}/health").json()
    assert health["activity"]["busy"] == 3 and health["queue"] == 0
    waiter = _whole_request(port, {**ENDLESS, "prompt": "w"})  # waits for a slot
    _wait_for(lambda: httpx.get(f"{url}/health").json()["queue"] == 1, what="one waiting")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, headers=_headers())
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
    waiter.close()  # its client gives up while it waits
    for s in slow:
        s.close()
    _wait_for(lambda: len(parallel3.lines("status=499")) >= before + 1, what="the waiter's 499")
    seen = [len(e) for e in events]
    _wait_for(lambda: all(len(e) > s + 5 for e, s in zip(events, seen, strict=True)))
    assert parallel3.process.poll() is None
    del third, streams  # they end with the server (cancelled, then [DONE])


def _slow_body(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 5000\r\n\r\n{"prompt'
    )
    return s


def _whole_request(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Length: %d\r\n\r\n" % len(data)
        + data
    )
    return s


def _open_and_drop(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")


@needs_slots
def test_real_sigterm_with_n_streams_running_and_one_waiting(tiny_llama_gguf: Path) -> None:
    port = _free_port()
    argv = [
        *SERVE,
        str(tiny_llama_gguf),
        "--port",
        str(port),
        "--threads",
        "1",
        "--context-length",
        "256",
    ]
    argv += ["--context-overflow", "slide", "--parallel", "3", "--max-queue", "2"]
    argv += ["--api-key", KEY]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(
        target=lambda: log.extend(iter(process.stderr.readline, "")), daemon=True
    ).start()
    url = f"http://127.0.0.1:{port}"
    events: list[list[Any]] = [[] for _ in range(4)]
    try:
        _wait_for(lambda: _answers(url) or process.poll() is not None, 120, "the server")
        streams = _endless_streams(url, events, 0, 1, 2)
        _wait_for(lambda: all(len(e) >= 3 for e in events[:3]), what="three streams running")
        streams += _endless_streams(url, events, 3)  # the fourth waits for a slot
        _wait_for(lambda: httpx.get(f"{url}/health").json()["queue"] == 1, what="one waiting")
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
    for t in streams:
        t.join(30)
    text = "".join(log)
    assert code == 0, text[-3000:]
    for e in events[:3]:
        assert e[0] == 200 and e[-1] == "[DONE]", e[-3:]
        assert e[-2]["choices"][0]["finish_reason"] == "cancelled", e[-3:]
    assert events[3] == [503], events[3]
    assert "3 running request(s) ended, 1 waiting request(s) answered 503" in text, text[-2000:]
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# -- the --parallel flag ------------------------------------------------------------------------


@cases(300)
@given(value=st.text(max_size=12) | st.integers(-5, 400).map(str))
def test_parallel_flag_is_a_slot_count_or_auto(value: str) -> None:
    from edgeinfer.cli.common import parse_parallel as _parallel
    from edgeinfer.errors import InvalidRequestError

    text = value.strip()
    try:
        got = _parallel(value)
    except InvalidRequestError as exc:
        assert "--parallel" in str(exc) and "\n" not in str(exc)
        assert not (text.isascii() and text.isdigit() and 1 <= int(text) <= 256)
        assert text.lower() != "auto"
        return
    assert got == "auto" if text.lower() == "auto" else got == int(text)


@pytest.mark.parametrize("value", ["0", "x", "\u0663"])
def test_a_bad_parallel_flag_is_one_line(tiny_llama_gguf: Path, value: str) -> None:
    done = subprocess.run(
        [*SERVE, str(tiny_llama_gguf), "--port", str(_free_port()), "--parallel", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1 and "--parallel" in done.stderr
