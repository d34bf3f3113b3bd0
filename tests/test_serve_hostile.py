"""`edgeinfer serve` against hostile input: bodies, headers, clients that leave, signals.

Two layers. Hypothesis drives the application in-process (Starlette's test client, fast
enough for hundreds of bodies and headers) and, with fewer cases, the real server process
over HTTP. Crash tests run the real `edgeinfer serve` on the tiny model, attack it, and
check that it still answers the official `openai` client, that a client that leaves stops
its generation within a few tokens, and that SIGTERM (once or twice) with a stream running
and a request waiting ends the stream with a final event and `[DONE]`, answers the waiting
request 503, logs one line and exits 0 without a traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import edgeinfer

hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llama_cpp")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .leakcheck import end_process  # noqa: E402
from .test_serve import CONTEXT, Server, _free_port, _start  # noqa: E402

KEY = "clé-🔑-ключ"  # non-ASCII: sent as its UTF-8 bytes
KEY_HEADER = b"Bearer " + KEY.encode()
BAN_EOS = {"2": -100}
ROUTES = ("/v1/chat/completions", "/v1/completions")
FIELDS = (
    "model messages prompt max_tokens max_completion_tokens temperature top_p seed stop n "
    "stream stream_options logit_bias response_format logprobs top_logprobs tools tool_choice "
    "frequency_penalty presence_penalty echo best_of suffix user"
).split()


def cases(n: int) -> settings:
    """Hypothesis settings for a suite of ``n`` generated cases (no deadline: a busy machine
    must not fail a test)."""
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# -- strategies -------------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def request_bodies(draw: Any) -> dict[str, Any]:
    """Bodies near the real shape with wrong types and out-of-range values in any field;
    generation is kept short (a small max_tokens) so valid ones finish fast."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Hi"}],
        "prompt": "Hi",
        "max_tokens": draw(st.integers(1, 4)),
        "logit_bias": BAN_EOS,
    }
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[key] = draw(
            json_value
            | st.sampled_from([2**63, 2**64 + 1, -(2**63) - 1, 10**30, 1e308, -1, 0, 1.5])
            | st.dictionaries(
                st.sampled_from(["0", "1", "99999999999999999999", " 1", "1_0", "٣", "-1", "x"]),
                st.integers(-200, 200) | st.floats(-1e9, 1e9),
                max_size=3,
            )
        )
    if body.get("max_tokens") is None or body.get("max_completion_tokens") is not None:
        body["max_tokens"] = 2  # keep any accepted request short
    body.pop("max_completion_tokens", None)
    if body.get("stream") is True:  # a stream's reply is not one JSON document
        del body["stream"]
    return body


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


unholdable = st.one_of(
    st.integers(1, 3000).map(lambda n: _nested(n).encode()),
    st.integers(20, 5000).map(lambda n: b'{"max_tokens": ' + b"9" * n + b', "prompt": "Hi"}'),
    st.integers(1, 400).map(lambda n: b'{"prompt": "Hi", "temperature": 1' + b"0" * n + b"}"),
    st.sampled_from([r"\ud800", r"\udfff", r"\ud83d", r"\ud83d\ude00x\udc00"]).map(
        lambda s: ('{"prompt": "' + s + '", "max_tokens": 1}').encode()
    ),
    st.sampled_from([b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xc3"}', b"\xef\xbb\xbf{}"]),
    st.sampled_from([b"NaN", b'{"temperature": NaN}', b'{"top_p": Infinity}', b"-Infinity"]),
)
raw_bodies = st.tuples(st.just(True), unholdable) | st.tuples(
    st.just(False),
    st.binary(max_size=64),  # anything, non-UTF-8 included
)


# -- the application in-process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_gguf: Path) -> Iterator[edgeinfer.Model]:
    with edgeinfer.load(tiny_llama_gguf, context_length=CONTEXT, threads=1) as model:
        yield model


def _client(model: edgeinfer.Model, **config: Any) -> Any:
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    app = create_app(model, ServerConfig(name="m", **config))
    return TestClient(app, base_url="http://127.0.0.1:8080", raise_server_exceptions=True)


def _is_error(r: Any, *statuses: int) -> None:
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in r.text


CASES: dict[str, int] = {}  # suite -> generated cases run (reported by the last test)


def _count(name: str) -> None:
    CASES[name] = CASES.get(name, 0) + 1


@cases(200)
@given(body=request_bodies(), route=st.sampled_from(ROUTES))
def test_wrong_fields_get_a_4xx_naming_them_never_a_500(
    tiny: edgeinfer.Model, body: dict[str, Any], route: str
) -> None:
    _count("fields")
    r = _client(tiny).post(route, json=body)
    if r.status_code == 200:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return
    _is_error(r, 400, 404)
    error = r.json()["error"]
    if r.status_code == 400 and error["code"] != "invalid_json":
        named = error["param"] or ""
        assert named.split("[")[0].split(".")[0] in (*FIELDS, "messages"), error


@cases(200)
@given(case=raw_bodies, route=st.sampled_from(ROUTES))
def test_unholdable_json_is_400_never_500(
    tiny: edgeinfer.Model, case: tuple[bool, bytes], route: str
) -> None:
    _count("raw bodies")
    hostile, raw = case
    r = _client(tiny).post(route, content=raw, headers={"content-type": "application/json"})
    if hostile or r.status_code != 200:  # random bytes are rarely a valid request
        _is_error(r, 400)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"seed": 2**63}, "seed", "seed"),
        ({"max_tokens": 2**64}, "max_tokens", "max_tokens"),
        ({"n": 2**64}, "n", "n"),
        ({"logit_bias": {"99999999999999999999": -100}}, "logit_bias", "99999999999999999999"),
        ({"logit_bias": {"1_0": 5}}, "logit_bias", "1_0"),
        ({"logit_bias": {" 12": 5}}, "logit_bias", " 12"),
        ({"logit_bias": {"\u0663": 5}}, "logit_bias", "logit_bias"),
        ({"logit_bias": {"9223372036854775807": 5}}, "logit_bias", "9223372036854775807"),
    ],
)
def test_numbers_beyond_int64_are_400_naming_the_field(
    tiny: edgeinfer.Model, fields: dict[str, Any], param: str, words: str
) -> None:
    r = _client(tiny).post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields})
    _is_error(r, 400)
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_bounded_json_names_the_field(tiny: edgeinfer.Model) -> None:
    client = _client(tiny)
    raw = b'{"prompt": "Hi", "messages": [{"role": "user", "content": "\\ud800"}]}'
    r = client.post("/v1/chat/completions", content=raw)
    _is_error(r, 400)
    assert "messages[0].content" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b'{"prompt": "Hi", "seed": ' + b"7" * 100 + b"}")
    _is_error(r, 400)
    assert "seed" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=_nested(100).encode())
    _is_error(r, 400)
    assert "nested" in r.json()["error"]["message"]


# -- Host and Origin ----------------------------------------------------------------------------

ALLOWED = ["localhost", "127.0.0.1", "[::1]", "LOCALHOST", "localhost.", "api.localhost"]
names = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,30}\.(com|net|org|test|io)", fullmatch=True)
ports = st.none() | st.integers(1, 65535)


def _with_port(name: str, port: int | None) -> str:
    return name if port is None else f"{name}:{port}"


@cases(200)
@given(name=st.sampled_from(ALLOWED), port=ports)
def test_loopback_names_are_answered(tiny: edgeinfer.Model, name: str, port: int | None) -> None:
    _count("allowed hosts")
    r = _client(tiny).get("/v1/models", headers={"host": _with_port(name, port)})
    assert r.status_code == 200, r.text


@cases(200)
@given(name=names | st.text(max_size=40) | st.binary(max_size=40), port=ports)
def test_other_hosts_are_403_before_anything_runs(
    tiny: edgeinfer.Model, name: str | bytes, port: int | None
) -> None:
    if isinstance(name, bytes):
        host: str | bytes = name
    else:
        host = _with_port(name, port)
        hypothesis.assume(host.isascii() and host.isprintable())
    from edgeinfer.serve.guard import host_name

    shown = host.decode("latin-1") if isinstance(host, bytes) else host
    hypothesis.assume(not shown.strip() or host_name(shown) not in ("localhost", "127.0.0.1"))
    _count("other hosts")
    try:
        r = _client(tiny).post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"host": host}
        )
    except (httpx.LocalProtocolError, ValueError):  # the client itself refused the value
        return
    name_of = host_name(shown)
    if name_of is not None and (name_of.endswith(".localhost") or _loopback_ip(name_of)):
        assert r.status_code == 200
        return
    _is_error(r, 403)
    assert r.json()["error"]["code"] == "host_not_allowed"


def _loopback_ip(name: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def test_allow_host_adds_a_name_and_the_bound_address_counts(tiny: edgeinfer.Model) -> None:
    assert _client(tiny).get("/v1/models", headers={"host": "mybox.lan:8080"}).status_code == 403
    opened = _client(tiny, allow_hosts=("mybox.lan",))
    assert opened.get("/v1/models", headers={"host": "mybox.lan:8080"}).status_code == 200
    bound = _client(tiny, host="192.168.7.7", api_key="k")
    r = bound.get("/v1/models", headers={"host": "192.168.7.7", "authorization": "Bearer k"})
    assert r.status_code == 200
    assert bound.get("/v1/models", headers={"host": "10.1.1.1"}).status_code == 403
    wildcard = _client(tiny, host="0.0.0.0", api_key="k")  # any address: none can be rebound
    r = wildcard.get("/v1/models", headers={"host": "10.1.1.1", "authorization": "Bearer k"})
    assert r.status_code == 200
    assert wildcard.get("/v1/models", headers={"host": "evil.test"}).status_code == 403


@cases(200)
@given(
    origin=st.from_regex(
        r"(https?|file|chrome-extension)://[a-z0-9.-]{1,20}(:[0-9]{1,5})?", fullmatch=True
    )
    | st.sampled_from(["null", "", "http://localhost:3001", "http://127.0.0.1"])
    | st.text(max_size=30)
)
def test_web_pages_are_refused_unless_named(tiny: edgeinfer.Model, origin: str) -> None:
    hypothesis.assume(origin.isascii() and origin.isprintable())
    hypothesis.assume(
        origin.strip().lower() not in ("http://127.0.0.1:8080", "http://localhost:3000")
    )
    _count("origins")
    closed, opened = _client(tiny), _client(tiny, cors_origin="http://localhost:3000")
    body = {"prompt": "Hi", "max_tokens": 1}
    for client in (closed, opened):
        r = client.post("/v1/completions", json=body, headers={"origin": origin})
        _is_error(r, 403)
        assert r.json()["error"]["code"] == "origin_not_allowed"
    r = opened.post("/v1/completions", json=body, headers={"origin": "http://localhost:3000"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


@cases(200)
@given(sent=st.binary(max_size=40) | st.text(max_size=20).map(lambda t: t.encode()))
def test_api_keys_compare_as_bytes_as_sent(tiny: edgeinfer.Model, sent: bytes) -> None:
    _count("authorization")
    client = _client(tiny, api_key=KEY)
    try:
        r = client.get("/v1/models", headers={"authorization": b"Bearer " + sent})
    except (httpx.LocalProtocolError, ValueError):
        return
    if sent.strip(b" \t") == KEY.encode():
        assert r.status_code == 200
    else:
        _is_error(r, 401)


def test_a_non_ascii_key_works_and_its_latin1_reading_does_not(tiny: edgeinfer.Model) -> None:
    client = _client(tiny, api_key=KEY)
    assert client.get("/v1/models", headers={"authorization": KEY_HEADER}).status_code == 200
    wrong = b"Bearer " + KEY.encode("utf-8").decode("latin-1").encode("utf-8")
    assert client.get("/v1/models", headers={"authorization": wrong}).status_code == 401


# -- the real server --------------------------------------------------------------------------


def _child_session() -> None:
    """The child starts with default signal handlers even under a background job."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="module")
def live(tiny_llama_gguf: Path) -> Iterator[Server]:
    yield from _start(tiny_llama_gguf, "--api-key", KEY, "--max-queue", "2")


def _auth(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"authorization": KEY_HEADER, "content-type": "application/json", **(extra or {})}


def _still_answers(server: Server) -> None:
    """The official client still gets a normal reply. It sends headers as ASCII, so the
    non-ASCII key's UTF-8 bytes go in through an httpx request hook."""

    def with_key(request: Any) -> None:
        raw = [(k, v) for k, v in request.headers.raw if k.lower() != b"authorization"]
        request.headers = httpx.Headers([*raw, (b"authorization", KEY_HEADER)])

    client = openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="replaced",
        max_retries=0,
        timeout=60,
        http_client=httpx.Client(event_hooks={"request": [with_key]}),
    )
    reply = client.completions.create(model="default", prompt="Hello", max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert server.process.poll() is None


@cases(40)
@given(
    raw=unholdable | st.binary(max_size=64) | request_bodies().map(lambda b: json.dumps(b).encode())
)
def test_live_server_bodies_never_500(live: Server, raw: bytes) -> None:
    _count("live bodies")
    r = httpx.post(f"{live.url}/v1/completions", content=raw, headers=_auth(), timeout=60)
    assert r.status_code != 500 and r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _send_raw(port: int, data: bytes, wait: float = 0.3) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        time.sleep(wait)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_live_server_survives_the_attack(live: Server) -> None:
    url, port = live.url, int(live.url.rsplit(":", 1)[1])
    bodies = [
        _nested(10_000).encode(),
        b'{"prompt": "Hi", "max_tokens": ' + b"9" * 4500 + b"}",
        b'{"prompt": "\\ud800", "max_tokens": 1}',
        b'{"prompt": "\xff", "max_tokens": 1}',
        b'{"prompt": "Hi", "logit_bias": {"99999999999999999999999": -100}}',
        b'{"prompt": "Hi", "seed": 18446744073709551617}',
        b'{"prompt": "Hi", "max_tokens": 1e400}',
    ]
    for raw in bodies:
        r = httpx.post(f"{url}/v1/completions", content=raw, headers=_auth(), timeout=60)
        _is_error(r, 400)
    for host in ("evil.test", "evil.test:8080", "127.0.0.1.evil.test", "localhost:8080@evil"):
        r = httpx.get(f"{url}/v1/models", headers=_auth({"host": host}))
        _is_error(r, 403)
    r = httpx.get(f"{url}/v1/models", headers=_auth({"origin": "http://evil.test"}))
    _is_error(r, 403)
    # a client that leaves mid-body: one 499 line, no traceback
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: " + KEY_HEADER + b'\r\nContent-Length: 1000\r\n\r\n{"prompt": '
    )
    before = len(live.lines(r"status=499"))
    _send_raw(port, head)
    _wait_for(lambda: len(live.lines(r"path=/v1/completions status=499")) > before)
    _still_answers(live)
    assert not live.lines("Traceback"), "".join(live.log)[-3000:]


def _wait_for(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting")
        time.sleep(0.05)


def _endless_server(model: Path, log: list[str], *extra: str) -> tuple[subprocess.Popen[str], str]:
    """A keyless server whose replies never end on their own (the context slides)."""
    port = _free_port()
    argv = [sys.executable, "-m", "edgeinfer.cli", "serve", str(model), "--port", str(port)]
    argv += ["--threads", "1", "--context-length", str(CONTEXT), "--context-overflow", "slide"]
    process = subprocess.Popen(
        [*argv, *extra], stderr=subprocess.PIPE, text=True, preexec_fn=_child_session
    )
    threading.Thread(
        target=lambda: log.extend(iter(process.stderr.readline, "")), daemon=True
    ).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail("".join(log)[-2000:])
            time.sleep(0.2)
    except BaseException:  # a failed start, a timeout: the server ends here
        end_process(process)
        raise


# 0 and 2 both end a reply of the tiny model: banned, with a sliding context, it never ends
ENDLESS = {"prompt": "Once upon a time", "max_tokens": 10**6, "logit_bias": {"0": -100, "2": -100}}


def test_a_whole_reply_whose_client_leaves_stops_within_a_few_tokens(
    tiny_llama_gguf: Path,
) -> None:
    log: list[str] = []
    process, url = _endless_server(tiny_llama_gguf, log)
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(f"{url}/v1/completions", json=ENDLESS, timeout=1.5)
        _wait_for(lambda: any("status=499" in line for line in log))
        (line,) = [line for line in log if "status=499" in line]
        generated = int(re.search(r"completion_tokens=(\d+)", line).group(1))
        late = int(re.search(r"tokens_after_cancel=(\d+)", line).group(1))
        assert generated > 0 and late <= 4, line  # it ran, and stopped at once
        assert httpx.get(f"{url}/health").json()["busy"] is False  # the model is free
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200
    finally:
        process.kill()
        process.wait(30)
    assert not [line for line in log if "Traceback" in line], "".join(log)[-3000:]


def _stream_until_done(url: str, events: list[str], started: threading.Event) -> None:
    body = {**ENDLESS, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) >= 3:
                    started.set()


@pytest.mark.parametrize("signals", [1, 2, 5])
def test_sigterm_ends_streams_refuses_the_queue_and_exits_0(
    tiny_llama_gguf: Path, signals: int
) -> None:
    log: list[str] = []
    process, url = _endless_server(tiny_llama_gguf, log)
    events: list[str] = []
    started = threading.Event()
    queued: list[httpx.Response] = []
    streamer = threading.Thread(target=_stream_until_done, args=(url, events, started))
    waiter = threading.Thread(
        target=lambda: queued.append(httpx.post(f"{url}/v1/completions", json=ENDLESS, timeout=60))
    )
    try:
        streamer.start()
        assert started.wait(60)
        waiter.start()
        _wait_for(lambda: httpx.get(f"{url}/health").json()["queue"] >= 1)
        for _ in range(signals):
            process.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
    streamer.join(30)
    waiter.join(30)
    assert code == 0, "".join(log)[-3000:]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])["choices"][0]
    assert final["finish_reason"] == "cancelled", events[-3:]
    assert queued and queued[0].status_code == 503, queued
    assert queued[0].json()["error"]["code"] == "server_shutting_down"
    text = "".join(log)
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    assert len([line for line in log if "shutting down" in line]) == 1, text[-3000:]


def test_empty_keys_are_refused_at_start(tiny_llama_gguf: Path) -> None:
    argv = [sys.executable, "-m", "edgeinfer.cli", "serve", str(tiny_llama_gguf)]
    argv += ["--port", str(_free_port())]
    for extra, env in (
        (["--api-key", ""], {}),
        ([], {"EDGEINFER_API_KEY": ""}),
        (["--api-key", " k"], {}),
    ):
        done = subprocess.run(
            [*argv, *extra], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
        )
        assert done.returncode != 0
        assert len(done.stderr.strip().splitlines()) == 1 and "api-key" in done.stderr, done.stderr


def test_zz_report_generated_cases() -> None:
    """Not a check: prints how many generated cases each suite ran (pytest -s shows it)."""
    print("\ngenerated cases:", json.dumps(CASES, sort_keys=True))
