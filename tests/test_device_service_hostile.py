"""apps/device_service.py against hostile input and signals, always the real process on a
tiny model: every line gets exactly one answer that is valid UTF-8 JSON, the service stays
alive and answers a normal request afterwards; repeated SIGTERM / SIGINT mid-reply end it
with exit status 0 and no traceback."""

from __future__ import annotations

import json
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.bounded_json import parse_json
from edgeinfer.errors import InvalidRequestError

from .leakcheck import KillAtEnd, end_process

SERVICE = Path(__file__).resolve().parents[1] / "apps" / "device_service.py"
FUZZ_EXAMPLES = 150  # lines per example: 1 to 4
NORMAL = {"id": "normal", "prompt": "Hello", "max_tokens": 2}
FIELDS = ["id", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop",
          "response_format", "logit_bias"]  # fmt: skip


class Live:
    """The service as a child process (its own session, so its signal handlers are its own
    and not a background job's inherited SIG_IGN); threads drain its stdout and stderr."""

    def __init__(self, model: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVICE), "--model", str(model), "--threads", "1",
             "--context-length", "256", "--max-new-tokens", "4", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        self.answers: queue.Queue[bytes] = queue.Queue()
        self.log: list[bytes] = []
        self.ready = threading.Event()
        self.loading = threading.Event()
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.answers.put(line)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if b'"loading"' in line:
                self.loading.set()
            if b'"ready"' in line:
                self.ready.set()

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def answer(self, timeout: float = 120) -> dict[str, Any]:
        raw = self.answers.get(timeout=timeout)
        return checked_answer(raw)

    def stderr(self) -> str:
        return b"".join(self.log).decode("utf-8", "replace")

    def close(self) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        return self.proc.wait(timeout=120)


def checked_answer(raw: bytes) -> dict[str, Any]:
    """One answer line: strict UTF-8, JSON without NaN or lone surrogates, the answer shape."""
    assert raw.endswith(b"\n"), raw[-200:]
    record = parse_json(raw, what="an answer")  # raises on invalid UTF-8 / NaN / surrogates
    assert isinstance(record, dict) and "id" in record, record
    if "error" in record:
        assert set(record["error"]) == {"type", "message"}
        assert all(isinstance(v, str) for v in record["error"].values())
    else:
        assert isinstance(record["text"], str) and record["finish_reason"] in (
            "stop", "length", "cancelled",
        )  # fmt: skip
    return record


@pytest.fixture(scope="module")
def live(tiny_llama_gguf: Path) -> Any:
    service = Live(tiny_llama_gguf)
    try:
        assert service.ready.wait(120), service.stderr()
        yield service
        service.close()
    finally:
        end_process(service.proc)


def normal_answer(live: Live) -> None:
    live.send(json.dumps(NORMAL).encode() + b"\n")
    record = live.answer()
    assert record["id"] == "normal" and record["usage"]["completion_tokens"] >= 1, record


# -- strategies ---------------------------------------------------------------------------

surrogates = st.integers(0xD800, 0xDFFF).map(chr)
texts = st.one_of(
    st.text(max_size=20),
    st.lists(st.one_of(st.characters(), surrogates), max_size=8).map("".join),
    st.integers(250, 300).map(lambda n: "x" * n),
)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(0, 4).map(lambda k: 10 ** (60 + k)),  # literals around the 64-character bound
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
scalars = st.one_of(st.none(), numbers, texts)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(texts, st.just("0")), inner,
                                                      max_size=4)
    ),
    max_leaves=12,
)  # fmt: skip
bias_keys = st.one_of(st.integers(0, 500).map(str), texts, st.just("-1"), st.just("1e3"))
logit_biases = st.one_of(
    values,
    st.dictionaries(bias_keys, st.one_of(numbers, st.integers(-150, 150), values), max_size=4),
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(scalars, values),
        "prompt": st.one_of(st.just("Hi"), texts, values),
        "messages": st.one_of(
            st.just([{"role": "user", "content": "Hi"}]),
            st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]), values,
                                     max_size=3), max_size=2),
            values,
        ),
        "max_tokens": st.one_of(st.integers(-2, 3), numbers, values),
        "temperature": st.one_of(st.just(0.5), numbers, values),
        "top_p": st.one_of(st.just(0.9), numbers, values),
        "seed": st.one_of(st.integers(0, 9), numbers, values),
        "stop": st.one_of(st.just("."), st.lists(texts, max_size=3), values),
        "response_format": st.one_of(st.just({"type": "text"}), values),
        "logit_bias": logit_biases,
        "unknown": values,
    },
)  # fmt: skip


def deep(n: int) -> bytes:
    return b'{"id": 1, "prompt": ' + b"[" * n + b"]" * n + b"}"


raw_lines = st.one_of(
    st.binary(max_size=200),
    st.integers(1, 3000).map(deep),
    st.integers(60, 5000).map(lambda n: b'{"id": 1' + b"0" * n + b', "prompt": "x"}'),
    st.tuples(st.binary(min_size=1, max_size=4), st.integers(0, 40)).map(
        lambda t: json.dumps(NORMAL).encode()[: t[1]] + b"\xff" + t[0]
    ),
    st.sampled_from([b'{"id": "\\ud800", "prompt": "x"}', b'{"id": NaN, "prompt": "x"}',
                     b'{"id": 1e999, "prompt": "x"}', b"\xef\xbb\xbf{}", b"[]", b"null",
                     b'"\\udfff"', b'{"prompt": "x", "logit_bias": [[1, 2]]}']),
)  # fmt: skip
lines = st.one_of(requests.map(lambda r: json.dumps(r).encode()), raw_lines)


def expected_id(line: bytes) -> Any:
    """The id the service must echo: the line's id when the line is a bounded JSON object
    and its id a string of <= 256 characters or an int64; otherwise null."""
    try:
        request = parse_json(line, what="line")
    except InvalidRequestError:
        return None
    rid = request.get("id") if isinstance(request, dict) else None
    if isinstance(rid, str) and len(rid) <= 256:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool) and -(2**63) <= rid < 2**63:
        return rid
    return None


def bias_is_valid(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            return False
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            return False
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            return False
    return True


# -- the properties -----------------------------------------------------------------------


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)  # fmt: skip
@given(st.lists(lines, min_size=1, max_size=4))
def test_every_line_gets_one_valid_answer(live: Live, batch: list[bytes]) -> None:
    batch = [line.replace(b"\n", b" ") for line in batch]
    live.send(b"".join(line + b"\n" for line in batch))
    for line in batch:
        if not line.strip():
            continue  # a blank line is no request: no answer
        record = live.answer()
        assert record["id"] == expected_id(line), (line[:300], record)
        request = _request_or_none(line)
        if (
            request is not None
            and "logit_bias" in request
            and not bias_is_valid(request["logit_bias"])
        ):
            assert "error" in record, (line[:300], record)
        if request is not None and set(request) - set(FIELDS):
            assert "unknown field" in record["error"]["message"], record
    assert live.proc.poll() is None, live.stderr()[-2000:]


def _request_or_none(line: bytes) -> dict[str, Any] | None:
    try:
        request = parse_json(line, what="line")
    except InvalidRequestError:
        return None
    if not isinstance(request, dict) or expected_id(line) != request.get("id"):
        return None
    return request


def test_still_answers_after_the_fuzz(live: Live) -> None:
    normal_answer(live)
    assert "Traceback" not in live.stderr()


@pytest.mark.parametrize(
    "bias, wrong",
    [
        ([[1, -100]], "logit_bias must be an object"),
        ("2:-100", "logit_bias must be an object"),
        ({"x": 1}, "logit_bias key"),
        ({"-1": 1}, "logit_bias key"),
        ({"1.0": 1}, "logit_bias key"),
        ({"2": "-100"}, "logit_bias[2]"),
        ({"2": True}, "logit_bias[2]"),
        ({"2": -101}, "logit_bias[2]"),
        ({"2": [1]}, "logit_bias[2]"),
    ],
)
def test_logit_bias_of_the_wrong_shape_is_refused(live: Live, bias: Any, wrong: str) -> None:
    live.send(json.dumps({"id": 7, "prompt": "Hi", "logit_bias": bias}).encode() + b"\n")
    record = live.answer()
    assert record["id"] == 7 and wrong in record["error"]["message"], record


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", "3"), ("max_tokens", 2.0), ("temperature", "hot"), ("top_p", None),
     ("seed", 1.5), ("stop", 3), ("stop", [""]), ("response_format", "json"),
     ("prompt", ["Hi"]), ("messages", [{"role": "user"}]), ("messages", "Hi"),
     ("max_new_tokens", 3)],
)  # fmt: skip
def test_each_field_is_checked_by_type(live: Live, field: str, value: Any) -> None:
    request = {"id": "t", "prompt": "Hi", field: value}
    if field == "messages":
        del request["prompt"]
    live.send(json.dumps(request).encode() + b"\n")
    record = live.answer()
    assert record["id"] == "t" and field in record["error"]["message"], record


def test_ids_it_cannot_echo_are_refused_as_null(live: Live) -> None:
    for rid in (2**63, -(2**63) - 1, 1.5, True, "x" * 257, [1], {"a": 1}):
        live.send(json.dumps({"id": rid, "prompt": "Hi"}).encode() + b"\n")
        record = live.answer()
        assert record["id"] is None and "id must be" in record["error"]["message"], record
    live.send(json.dumps({"id": 2**63 - 1, "prompt": "Hi", "max_tokens": 1}).encode() + b"\n")
    assert live.answer()["id"] == 2**63 - 1


def test_a_line_too_long_is_skipped_without_holding_it(live: Live) -> None:
    process = psutil.Process(live.proc.pid)
    before = process.memory_info().rss
    chunk = b"a" * 2**20
    for _ in range(24):  # 24 MiB in one line
        live.send(chunk)
    live.send(b"\n")
    record = live.answer()
    assert record["id"] is None and "25,165,824 bytes" in record["error"]["message"], record
    assert process.memory_info().rss - before < 16 * 2**20  # never held whole
    normal_answer(live)


def test_invalid_utf8_is_answered_never_echoed(live: Live) -> None:
    live.send(b'{"id": "caf\xe9", "prompt": "x"}\n')
    raw = live.answers.get(timeout=60)
    raw.decode("utf-8")  # strict
    record = json.loads(raw)
    assert record["id"] is None and "not UTF-8" in record["error"]["message"]
    normal_answer(live)


# -- signals ------------------------------------------------------------------------------

BUSY = {"prompt": "Once upon a time", "max_tokens": 250, "temperature": 0.8}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("attempt", range(3))
def test_signals_mid_reply_end_cleanly(
    tiny_llama_gguf: Path, signum: int, attempt: int, kill_at_end: KillAtEnd
) -> None:
    service = Live(tiny_llama_gguf)
    kill_at_end(service.proc)
    assert service.ready.wait(120), service.stderr()
    # a queue of long replies, so that the signals find one in progress
    service.send(b"".join(json.dumps({**BUSY, "id": i, "seed": i}).encode() + b"\n"
                          for i in range(200)))  # fmt: skip
    service.answer()
    rng = random.Random(attempt)
    time.sleep(rng.uniform(0, 0.05))
    service.proc.send_signal(signum)
    # the second one: at once, a little later, or a burst that reaches the engine's teardown
    if attempt == 0:
        service.proc.send_signal(signum)
    elif attempt == 1:
        time.sleep(rng.uniform(0.001, 0.02))
        service.proc.send_signal(signum)
    else:
        for _ in range(30):
            try:
                service.proc.send_signal(signum)
            except ProcessLookupError:
                break
            time.sleep(0.002)
    assert service.proc.wait(timeout=120) == 0, service.stderr()
    time.sleep(0.2)  # the reader threads drain what is left
    err = service.stderr()
    assert "Traceback" not in err and "Segmentation" not in err, err
    events = [json.loads(line) for line in err.splitlines()]
    assert events[-1]["event"] == "stopped"
    signals = [e for e in events if e["event"] == "signal"]
    assert signals and signals[0]["action"] == "stopping"
    assert all(e["action"] == "already stopping" for e in signals[1:])
    answers = []
    while not service.answers.empty():
        answers.append(checked_answer(service.answers.get()))
    assert answers and len(answers) < 199  # it stopped, and wrote what it answered
    assert all(a["finish_reason"] in ("length", "stop") for a in answers[:-1])


def test_sigterm_while_loading_exits_0_once_loaded(
    tiny_llama_gguf: Path, kill_at_end: KillAtEnd
) -> None:
    service = Live(tiny_llama_gguf)
    kill_at_end(service.proc)
    assert service.loading.wait(120), service.stderr()  # its handlers are in place
    service.proc.send_signal(signal.SIGTERM)
    assert service.proc.wait(timeout=120) == 0, service.stderr()
    time.sleep(0.2)
    assert "Traceback" not in service.stderr()


def test_a_closed_output_stops_the_service(tiny_llama_gguf: Path, kill_at_end: KillAtEnd) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read the answers
    proc = kill_at_end(subprocess.Popen(
        [sys.executable, str(SERVICE), "--model", str(tiny_llama_gguf), "--threads", "1"],
        stdin=subprocess.PIPE, stdout=write_end, stderr=subprocess.PIPE, start_new_session=True,
    ))  # fmt: skip
    os.close(write_end)
    requests = b"".join(json.dumps({**NORMAL, "id": i}).encode() + b"\n" for i in range(20))
    _, err = proc.communicate(requests, timeout=120)
    assert proc.returncode == 0, err
    assert b"Traceback" not in err and b'"output_closed"' in err


def test_output_encoding_never_fails() -> None:
    sys.path.insert(0, str(SERVICE.parent))
    try:
        from device_service import encode_answer
    finally:
        sys.path.pop(0)
    for parsed in (math.inf, math.nan, 10**5000, "\ud800", {"a": object()}):
        raw = encode_answer({"id": 1, "text": "x", "parsed": parsed})
        record = parse_json(raw, what="answer")
        assert record["id"] == 1 and record["error"]["type"] == "internal_error"
    assert json.loads(encode_answer({"id": 1, "text": "héllo"})) == {"id": 1, "text": "héllo"}


def _line_reader() -> Any:
    sys.path.insert(0, str(SERVICE.parent))
    try:
        from device_service import LineReader
    finally:
        sys.path.pop(0)
    return LineReader


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), max_size=8),
    st.booleans(),
    st.lists(st.integers(1, 9), min_size=1, max_size=10),
    st.integers(0, 10),
)
def test_line_reader_matches_a_plain_split(
    parts: list[bytes], trailing: bool, cuts: list[int], limit: int
) -> None:
    """However the input is cut into chunks, the reader hands on each line of <= limit
    bytes as it is and each longer one as its length."""
    data = b"\n".join(parts) + (b"\n" if trailing else b"")
    reader = _line_reader()(limit)
    got: list[bytes | int] = []
    at, i = 0, 0
    while at < len(data):
        size = cuts[i % len(cuts)]
        got += reader.feed(data[at : at + size])
        at, i = at + size, i + 1
    got += reader.finish()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # a final newline ends the last line, it does not start another
    assert got == [line if len(line) <= limit else len(line) for line in lines]


def test_a_line_that_is_not_json_is_logged_on_stderr(live: Live) -> None:
    live.send(b"hello, not json\n")
    record = live.answer()
    assert record["id"] is None and record["error"]["type"] == "invalid_json", record
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # stderr is drained by a thread of its own
        events = [json.loads(line) for line in live.stderr().splitlines() if line.startswith("{")]
        if any(e["event"] == "refused" and "not JSON" in e["error"] for e in events):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"no 'refused' log line for a non-JSON line: {live.stderr()!r}")
    normal_answer(live)
