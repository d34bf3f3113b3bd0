"""`edgeinfer serve` for real: the server on a free loopback port in its own process, driven
by the official `openai` client (and httpx where the client hides the wire), its answers
compared with the Python API on the same model file in this process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import edgeinfer

from .leakcheck import end_process

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llama_cpp")

KEY = "test-key-123"
MODEL_ID = "default"  # the server also answers to "default" besides its model's name
CONTEXT = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[str]
    log: list[str]
    model: str  # the id it serves: the model as named on its command line

    def client(self, key: str = KEY) -> object:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def lines(self, pattern: str) -> list[str]:
        return [line for line in self.log if re.search(pattern, line)]


def _start(model: Path, *extra: str, context: int | None = CONTEXT) -> Iterator[Server]:
    """``context=None`` for an embedding model, which refuses a context length."""
    port = _free_port()
    argv = [sys.executable, "-m", "edgeinfer.cli", "serve", str(model), "--port", str(port)]
    argv += ["--threads", "1"]
    if context is not None:
        argv += ["--context-length", str(context)]
    argv += extra  # after the defaults: a --context-length of the caller's wins
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ})
    log: list[str] = []
    reader = threading.Thread(
        target=lambda: log.extend(iter(process.stderr.readline, "")), daemon=True
    )
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                reader.join(5)
                pytest.fail(f"the server exited: {''.join(log)[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not answer /health within 120 s")
    except BaseException:  # a failed start, a timeout: the server ends here
        end_process(process)
        raise
    try:
        yield Server(url, process, log, str(model))
    finally:
        process.terminate()  # SIGTERM: a graceful stop, the model closed after its requests
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        end_process(process)  # killed, with whatever it started, if SIGTERM did not end it
    # a graceful stop on SIGTERM ends with exit code 0 and no traceback
    assert code == 0, "".join(log)[-2000:]
    assert "Traceback" not in "".join(log), "".join(log)[-2000:]


@pytest.fixture(scope="module")
def server(tiny_llama_gguf: Path) -> Iterator[Server]:
    yield from _start(tiny_llama_gguf, "--api-key", KEY, "--max-queue", "4")


@pytest.fixture(scope="module")
def local(tiny_llama_gguf: Path) -> Iterator[edgeinfer.Model]:
    """The same file through the Python API: what a fresh model gives."""
    with edgeinfer.load(tiny_llama_gguf, context_length=CONTEXT, threads=1) as model:
        yield model


GREEDY = {"temperature": 0, "max_tokens": 12}
BAN_EOS = {"2": -100}  # the tiny model's end-of-generation id: every reply runs its length
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


def test_models_lists_the_served_model(server: Server, tiny_llama_gguf: Path) -> None:
    ids = [m.id for m in server.client().models.list().data]
    assert ids == [str(tiny_llama_gguf)]


def test_chat_matches_the_python_api_with_usage(
    server: Server, local: edgeinfer.Model, tiny_llama_gguf: Path
) -> None:
    reply = server.client().chat.completions.create(
        model=str(tiny_llama_gguf), messages=MESSAGES, logit_bias=BAN_EOS, **GREEDY
    )
    want = local.chat(MESSAGES, temperature=0, max_new_tokens=12, logit_bias={2: float("-inf")})
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == want.stats.prompt_tokens
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == want.stats.prompt_tokens + 12


def test_streamed_chat_equals_the_whole_reply(server: Server) -> None:
    client = server.client()
    # long enough that its second read reuses 32 tokens and still reads 8 or more again
    messages = [{"role": "user", "content": "Hello there, how are you on this fine day?"}]
    whole = client.chat.completions.create(
        model=MODEL_ID, messages=messages, logit_bias=BAN_EOS, **GREEDY
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID,
            messages=messages,
            logit_bias=BAN_EOS,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # the second read of the same prompt reuses the cache: the usage says so
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_stream_and_whole_match_the_python_api(
    server: Server, local: edgeinfer.Model
) -> None:
    client = server.client()
    prompt = "The quick brown fox"
    whole = client.completions.create(model=MODEL_ID, prompt=prompt, logit_bias=BAN_EOS, **GREEDY)
    want = local.generate(prompt, temperature=0, max_new_tokens=12, logit_bias={2: float("-inf")})
    assert whole.choices[0].text == want.text
    streamed = client.completions.create(
        model=MODEL_ID, prompt=prompt, logit_bias=BAN_EOS, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text


def test_stop_strings_end_the_reply_before_them(server: Server, local: edgeinfer.Model) -> None:
    prompt = "The quick brown fox"
    full = local.generate(prompt, temperature=0, max_new_tokens=24, logit_bias={2: float("-inf")})
    text = full.text
    cut = next(i for i in range(len(text) // 2, len(text)) if text[i].strip())
    stop = text[cut : cut + 2]
    reply = server.client().completions.create(
        model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=24, logit_bias=BAN_EOS, stop=[stop]
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == text[: text.index(stop)]


def test_wrong_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        server.client("wrong").chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=2
        )
    assert info.value.status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logprobs": "yes"}, "logprobs"),  # logprobs are taken; a bad value is refused
    ],
)
def test_bad_fields_are_400_naming_the_field(
    server: Server, fields: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL_ID, messages=MESSAGES, **fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def test_unknown_model_is_404_and_bad_requests_never_500(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{server.url}/v1/chat/completions"
    for body in (b"{not json", b"[]", b'{"messages": "hi"}', b'{"messages": [{"role": 1}]}'):
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == 400 and "Traceback" not in r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url, content=b"x" * (5 * 2**20), headers=headers)
    assert r.status_code == 413
    long_prompt = "word " * (CONTEXT * 2)
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": long_prompt, "max_tokens": 2},
        headers=headers,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert server.process.poll() is None  # still serving


def test_disconnect_cancels_and_the_next_request_is_fresh(
    server: Server, local: edgeinfer.Model
) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "prompt": "Once upon a time",
        "max_tokens": CONTEXT,
        "temperature": 0.9,
        "seed": 7,
        "logit_bias": BAN_EOS,
        "stream": True,
    }
    received = 0
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
                if received == 3:
                    break  # hang up mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not server.lines(r"status=499"):
        time.sleep(0.05)
    (line,) = server.lines(r"status=499")
    generated = int(re.search(r"completion_tokens=(\d+)", line).group(1))
    late = int(re.search(r"tokens_after_cancel=(\d+)", line).group(1))
    # "within a token": after the server saw the client leave, the step under way ends (and
    # one token may have been made but not yet handed to the reply); nothing more is generated
    assert 3 <= generated and late <= 2, line
    reply = server.client().completions.create(
        model=MODEL_ID, prompt="The quick brown fox", logit_bias=BAN_EOS, **GREEDY
    )
    want = local.generate(
        "The quick brown fox", temperature=0, max_new_tokens=12, logit_bias={2: float("-inf")}
    )
    assert reply.choices[0].text == want.text


def test_health_reports_the_model_and_its_memory(server: Server) -> None:
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["queue"] == 0
    assert health["memory_plan"]["context_length"] == CONTEXT
    assert health["peak_rss_bytes"] > 0


def test_requests_are_logged_one_line_each(server: Server) -> None:
    server.client().completions.create(model=MODEL_ID, prompt="Hello", max_tokens=3, temperature=0)
    deadline = time.monotonic() + 30  # the access line follows the reply
    while time.monotonic() < deadline and not server.lines(r"path=/v1/completions status=200"):
        time.sleep(0.05)
    line = server.lines(r"path=/v1/completions status=200 .*prompt_tokens=")[-1]
    assert "ttft_ms=" in line and "decode_tok_s=" in line


# -- settings refused before serving -----------------------------------------------------------


def _serve_fails(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    return done.stderr


def test_other_addresses_need_a_key(tiny_llama_gguf: Path) -> None:
    env_key = os.environ.pop("EDGEINFER_API_KEY", None)
    try:
        err = _serve_fails(str(tiny_llama_gguf), "--host", "0.0.0.0", "--port", str(_free_port()))
    finally:
        if env_key is not None:
            os.environ["EDGEINFER_API_KEY"] = env_key
    assert "set --api-key" in err and len(err.strip().splitlines()) == 1


def test_a_port_in_use_is_one_line(tiny_llama_gguf: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        err = _serve_fails(str(tiny_llama_gguf), "--port", str(s.getsockname()[1]))
    assert "cannot listen on 127.0.0.1" in err


# -- the queue, on the default model (slow enough to hold the model) -----------------------


@pytest.mark.model
def test_past_the_queue_limit_is_503_with_retry_after(default_gguf: Path) -> None:
    for srv in _start(default_gguf, "--max-queue", "1"):
        client = srv.client()
        long = {"prompt": "Once upon a time", "max_tokens": 200, "logit_bias": {"2": -100}}
        results: list[object] = []

        def ask(
            client: object = client, body: dict[str, object] = long, out: list[object] = results
        ) -> None:
            out.append(client.completions.create(model=MODEL_ID, **body))  # type: ignore[attr-defined]

        threads = [threading.Thread(target=ask) for _ in range(2)]
        threads[0].start()
        deadline = time.monotonic() + 30
        while not httpx.get(f"{srv.url}/health").json()["busy"] and time.monotonic() < deadline:
            time.sleep(0.02)
        threads[1].start()
        while httpx.get(f"{srv.url}/health").json()["queue"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"].isdigit()
        assert r.json()["error"]["code"] == "server_busy"
        for t in threads:
            t.join(120)
        assert len(results) == 2  # the running and the waiting request both finished
        assert json.loads(httpx.get(f"{srv.url}/health").text)["queue"] == 0


# -- the application in-process (Starlette's test client) ----------------------------------


def test_cors_only_for_the_named_origin(local: edgeinfer.Model) -> None:
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    preflight = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    closed = TestClient(create_app(local, ServerConfig(name="m")), base_url="http://127.0.0.1")
    r = closed.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    opened = TestClient(
        create_app(local, ServerConfig(name="m", cors_origin="http://localhost:3000")),
        base_url="http://localhost:8080",
    )
    r = opened.options("/v1/chat/completions", headers=preflight)
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = opened.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.test"})
    assert r.headers.get("access-control-allow-origin") != "*"
    assert opened.get("/v1/chat/completions").status_code == 405  # POST only, JSON error
    assert opened.get("/nowhere").json()["error"]["code"] == "not_found"


# -- the small refusals: what OpenAI's clients send and expect ---------------------------------


def test_developer_role_is_read_as_system(server: Server) -> None:
    client = server.client()
    asked = [{"role": "developer", "content": "Be terse."}, *MESSAGES]
    got = client.chat.completions.create(model=MODEL_ID, messages=asked, **GREEDY)
    system = [{"role": "system", "content": "Be terse."}, *MESSAGES]
    want = client.chat.completions.create(model=MODEL_ID, messages=system, **GREEDY)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_models_retrieve_by_name_and_unknown_is_404_with_the_hint(server: Server) -> None:
    client = server.client()
    for name in (server.model, MODEL_ID):
        entry = client.models.retrieve(name)
        assert entry.id == server.model and entry.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["param"] == "model" and "--any-model-name" in info.value.body["message"]
    assert httpx.get(f"{server.url}/v1/models/{MODEL_ID}").status_code == 401  # key needed


def test_a_prompt_over_the_context_names_the_field_that_holds_it(server: Server) -> None:
    client = server.client()
    long_prompt = "word " * (CONTEXT * 2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt=long_prompt, max_tokens=2)
    assert info.value.body["param"] == "prompt"
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": long_prompt}], max_tokens=2
        )
    assert chat.value.body["param"] == "messages"


def test_chat_without_a_chat_template_answers_in_http_terms(
    local: edgeinfer.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    monkeypatch.setattr(type(local), "chat_template", property(lambda self: None))
    client = TestClient(create_app(local, ServerConfig(name="m")), base_url="http://127.0.0.1")
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/responses", {"input": "Hi"}),
    ):
        error = client.post(path, json=body).json()["error"]
        assert error["code"] == "no_chat_template" and "POST /v1/completions" in error["message"]
        assert "generate()" not in error["message"]
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
