"""The request field ``speculative`` wherever a request is written by a stranger: the Responses
API (``/v1/responses``), chat and text completions, and the rows of ``edgeinfer batch``.

Each is checked for what the field must do, not only that it is accepted: with ``"lookup"``
the model drafts (its stats count drafted tokens) and the reply is the one ``"off"`` gives; a
bad value is a typed refusal naming the field (a 400 from the server, the row's error record
in a batch job) and the server or the job goes on.

Drafting is read from the model's own stats: the server runs in this process on a real
loopback port (uvicorn in a thread, the official openai client in front), with the model's
``chat`` and ``stream`` recording the token streams they hand to the server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import edgeinfer

from .test_serve import Server, _free_port, _start
from .test_serve_speculative import EOS_BAN, PROMPT, write_tiny

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

TOKENS = 24
MESSAGES = [{"role": "user", "content": PROMPT}]
BAD = ["sometimes", 3, {"a": 1}, "lookup:0", True, [1], "x" * 10_240]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("spec-fields") / "t.gguf")


# -- the server in this process, its model's streams recorded ---------------------------------


@dataclass
class Live:
    """A server on a loopback port in this process, and the token streams its model handed
    out, in order (``stats`` reads the last one's)."""

    url: str
    streams: list[Any] = field(default_factory=list)

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=60)

    def stats(self) -> Any:
        return self.streams[-1].result.stats


def _recording(method: Callable[..., Any], streams: list[Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        streams.append(out)
        return out

    return call


@pytest.fixture(scope="module")
def live(tiny: Path) -> Iterator[Live]:
    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    with edgeinfer.load(tiny, context_length=256, threads=1) as model:
        found = Live("")
        model.chat = _recording(model.chat, found.streams)  # type: ignore[method-assign]
        model.stream = _recording(model.stream, found.streams)  # type: ignore[method-assign]
        port = _free_port()
        config = uvicorn.Config(create_app(model, ServerConfig(name="m")), host="127.0.0.1",
                                port=port, log_level="warning")  # fmt: skip
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="spec-fields-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started, "the in-process server did not start"
        found.url = f"http://127.0.0.1:{port}"
        try:
            yield found
        finally:
            server.should_exit = True
            thread.join(30)


def _ask(live: Live, endpoint: str, speculative: str) -> tuple[str, Any]:
    """One greedy request to ``endpoint`` through the openai client: its text, and the
    stats of the generation the model ran for it."""
    client, extra = live.client(), {"speculative": speculative}
    if endpoint == "responses":
        extra["logit_bias"] = EOS_BAN  # edgeinfer's field on /v1/responses
        reply = client.responses.create(model="m", input=PROMPT, max_output_tokens=TOKENS,
                                        temperature=0, extra_body=extra)  # fmt: skip
        text = reply.output_text
    elif endpoint == "chat":
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=TOKENS,
                                               temperature=0, logit_bias=EOS_BAN,
                                               extra_body=extra)  # fmt: skip
        text = reply.choices[0].message.content
    else:
        reply = client.completions.create(model="m", prompt=PROMPT, max_tokens=TOKENS,
                                          temperature=0, logit_bias=EOS_BAN,
                                          extra_body=extra)  # fmt: skip
        text = reply.choices[0].text
    return text, live.stats()


@pytest.mark.parametrize("endpoint", ["responses", "chat", "completions"])
def test_lookup_drafts_and_replies_as_off_does(live: Live, endpoint: str) -> None:
    plain, plain_stats = _ask(live, endpoint, "off")
    fast, fast_stats = _ask(live, endpoint, "lookup")
    assert plain_stats.completion_tokens == fast_stats.completion_tokens == TOKENS
    assert fast == plain
    assert plain_stats.draft_tokens == 0
    assert fast_stats.draft_tokens > 0  # verify passes ran: the field reached the model
    assert 0 <= fast_stats.accepted_tokens <= fast_stats.draft_tokens


def test_a_responses_stream_takes_it_too(live: Live) -> None:
    client = live.client()
    extra = {"speculative": "lookup", "logit_bias": EOS_BAN}
    events = list(client.responses.create(model="m", input=PROMPT, max_output_tokens=TOKENS,
                                          temperature=0, stream=True,
                                          extra_body=extra))  # fmt: skip
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert live.stats().draft_tokens > 0
    plain, _ = _ask(live, "responses", "off")
    assert streamed == plain


# -- the real server: bad values --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Server]:
    yield from _start(tiny)


def _responses(server: Server, **fields: Any) -> httpx.Response:
    body = {"model": "default", "input": PROMPT, "max_output_tokens": TOKENS, "temperature": 0,
            "logit_bias": EOS_BAN, **fields}  # fmt: skip
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)


def test_the_real_server_answers_lookup_on_responses_as_off(server: Server) -> None:
    plain = _responses(server, speculative="off")
    fast = _responses(server, speculative="lookup")
    default = _responses(server, speculative=None)  # null: the server's default ("off")
    assert plain.status_code == fast.status_code == default.status_code == 200, fast.text
    texts = [r.json()["output"][0]["content"][0]["text"] for r in (plain, fast, default)]
    assert texts[0] == texts[1] == texts[2] and texts[0]
    assert fast.json()["usage"]["output_tokens"] == TOKENS


@pytest.mark.parametrize("value", BAD, ids=lambda v: repr(v)[:20])
def test_a_bad_value_on_responses_is_a_typed_400(server: Server, value: object) -> None:
    r = _responses(server, speculative=value)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"] == "speculative"
    assert "expected 'off', 'auto'" in error["message"]  # it says what to send instead
    assert len(error["message"]) < 1000  # a 10 KB value is not echoed whole
    assert server.process.poll() is None
    after = _responses(server, speculative="lookup", max_output_tokens=3)
    assert after.status_code == 200 and after.json()["status"] == "incomplete"


def test_a_draft_model_it_was_not_loaded_with_is_a_400_on_responses(server: Server) -> None:
    r = _responses(server, speculative="draft:other")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "speculative" and "loaded without a draft model" in error["message"]


# -- edgeinfer batch --------------------------------------------------------------------------


def _batch(tiny: Path, tmp_path: Path, rows: list[dict[str, Any]], *flags: str) -> list[dict]:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "edgeinfer", "batch", str(tiny), str(src), "-o", str(out)]
    argv += ["--temperature", "0", "--threads", "1", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def _row(row_id: str, speculative: object, chat: bool = False) -> dict[str, Any]:
    ask = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    return {"id": row_id, **ask, "max_tokens": TOKENS, "logit_bias": EOS_BAN,
            "speculative": speculative}  # fmt: skip


def test_batch_rows_take_speculative(tiny: Path, tmp_path: Path) -> None:
    rows = [
        _row("off", "off"),
        _row("lookup", "lookup"),
        _row("bad", "sometimes"),
        _row("bad-type", 3),
        _row("bad-draft", "draft:other"),  # a draft model it was not loaded with
        _row("chat-off", "off", chat=True),
        _row("chat-lookup", "lookup:4", chat=True),
        _row("default", None),  # null: the job's default ("off")
    ]
    got = {r["id"]: r for r in _batch(tiny, tmp_path, rows)}
    assert list(got) == [r["id"] for r in rows]
    for off, on in (("off", "lookup"), ("chat-off", "chat-lookup")):
        assert got[off]["error"] is None and got[on]["error"] is None
        assert got[on]["text"] == got[off]["text"] == got["default"]["text"]
        assert got[on]["usage"]["completion_tokens"] == TOKENS
        assert got[off]["usage"]["draft_tokens"] == got[off]["usage"]["accepted_tokens"] == 0
        assert got[on]["usage"]["draft_tokens"] > 0
        assert 0 <= got[on]["usage"]["accepted_tokens"] <= got[on]["usage"]["draft_tokens"]
    assert got["default"]["usage"]["draft_tokens"] == 0
    for bad in ("bad", "bad-type", "bad-draft"):
        assert got[bad]["text"] is None and got[bad]["usage"] is None, got[bad]
        assert got[bad]["error"]["type"] == "InvalidRequestError"
        assert got[bad]["error"]["message"].startswith("speculative="), got[bad]["error"]
    assert "expected 'off', 'auto'" in got["bad"]["error"]["message"]


def test_a_row_overrides_the_jobs_speculative(tiny: Path, tmp_path: Path) -> None:
    rows = [_row("default", None), _row("off", "off")]
    got = {r["id"]: r for r in _batch(tiny, tmp_path, rows, "--speculative", "lookup")}
    assert got["default"]["usage"]["draft_tokens"] > 0  # the job's --speculative lookup
    assert got["off"]["usage"]["draft_tokens"] == 0
    assert got["default"]["text"] == got["off"]["text"]
