"""A headless service for a Raspberry Pi or a Jetson: requests in as JSON lines on stdin,
answers out as JSON lines on stdout, its own log as JSON lines on stderr. Built only on
edgeinfer's public API; meant to run under systemd (see apps/edgeinfer-device.service).

A request: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [{"role", "content"}]},
optionally with "max_tokens", "temperature", "top_p", "seed", "stop", "response_format" and
"logit_bias" ({"token id": bias from -100 to 100}; -100 bans the token). "id" is echoed in
the answer: a string of at most 256 characters, an integer within +-2**63, or null.
An answer: {"id", "text", "finish_reason", "usage": {...}, "ttft_ms", "decode_tok_s"}
(plus "parsed" under a JSON response_format), or {"id", "error": {"type", "message"}} for a
request that cannot be served; the service goes on with the next line.

Every line is read as bytes and parsed with bounds (edgeinfer.bounded_json): at most 1 MiB, 64
levels deep, number literals of at most 64 characters, UTF-8 without lone surrogates. A line
that breaks a bound, or a field of the wrong type or shape, gets an error record naming it;
a longer line is skipped as it arrives, never held whole. Answers are always UTF-8 JSON.

SIGTERM (systemctl stop) or SIGINT ends the reply in progress (its answer is written, with
finish_reason "cancelled") and exits 0. The handlers only set a flag: a signal never raises
inside the engine (nor inside its teardown), and a second one is only logged.

Memory: unless --memory-budget is given, the budget is 75% of the board's RAM, leaving at
least 512 MiB to the OS, and never more than the RAM available when the service starts.

    echo '{"id": 1, "prompt": "The capital of France is"}' | python apps/device_service.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil

import edgeinfer
from edgeinfer.bounded_json import parse_json

OS_RESERVE = 512 * 2**20
SHARE = 0.75
MAX_LINE_BYTES = 2**20  # one request line; a longer one is skipped as it arrives
READ_CHUNK = 2**16
MAX_ID_CHARS = 256
MAX_STOPS = 16
MAX_BIAS = 100  # OpenAI's logit_bias range; -100 bans the token
_SAMPLING = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
             "seed": "seed", "stop": "stop", "response_format": "response_format"}  # fmt: skip
_FIELDS = ("id", "prompt", "messages", *_SAMPLING, "logit_bias")
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def board_budget(total: int, available: int) -> int:
    """75% of the RAM, at least 512 MiB left to the OS, at most what is available."""
    return max(0, min(int(total * SHARE), total - OS_RESERVE, available))


def log(event: str, **fields: Any) -> None:
    """One JSON line on stderr (ASCII: whatever a field holds, the log stays valid UTF-8)."""
    record = {"time": round(time.time(), 3), "event": event, **fields}
    try:
        print(json.dumps(record, default=repr), file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the journal went away: the service goes on
        pass


def encode_answer(record: dict[str, Any]) -> bytes:
    """``record`` as one line of UTF-8 JSON. Should a value not be JSON (a non-finite or
    enormous number in ``parsed``), the line is an error record instead: never invalid JSON."""
    try:
        text = json.dumps(record, ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8") + b"\n"
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        message = f"the answer could not be written as JSON ({type(exc).__name__}: {exc})"
        error = {"type": "internal_error", "message": message[:300]}
        return json.dumps({"id": record.get("id"), "error": error}).encode("ascii") + b"\n"


# -- reading requests ---------------------------------------------------------------------


class LineReader:
    """Lines of at most ``limit`` bytes from chunks of input. A longer line is dropped as its
    bytes arrive (memory stays at ``limit``) and is handed on as its length in bytes."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self.limit = limit
        self.pending = bytearray()
        self.dropped = 0  # bytes of the current line dropped so far (0: none)

    def feed(self, chunk: bytes) -> Iterator[bytes | int]:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            yield self._take(chunk[start:end])
            start = end + 1
        self._keep(chunk[start:])

    def finish(self) -> Iterator[bytes | int]:
        """The last line, when the input ends without a newline."""
        if self.pending or self.dropped:
            yield self._take(b"")

    def _take(self, piece: bytes) -> bytes | int:
        self._keep(piece)
        line: bytes | int = self.dropped or bytes(self.pending)
        self.pending.clear()
        self.dropped = 0
        return line

    def _keep(self, piece: bytes) -> None:
        if self.dropped:
            self.dropped += len(piece)
        elif len(self.pending) + len(piece) > self.limit:
            self.dropped = len(self.pending) + len(piece)
            self.pending.clear()
        else:
            self.pending += piece


def wait_for_input(fd: int, wake: int | None) -> bool:
    """Wait until ``fd`` has input (True) or a signal wrote to ``wake`` (False)."""
    if wake is None:  # no select() on this platform's pipes: a plain blocking read
        return True
    ready, _, _ = select.select([fd, wake], [], [])
    if wake in ready:
        try:
            os.read(wake, 64)  # drain the signal bytes
        except OSError:
            pass
    return fd in ready


# -- checking requests --------------------------------------------------------------------


def bad(message: str) -> edgeinfer.InvalidRequestError:
    return edgeinfer.InvalidRequestError(message)


def request_id(request: dict[str, Any]) -> str | int | None:
    """The id to echo: a string, an int64 or null; anything else is refused (as id null)."""
    rid = request.get("id")
    if rid is None:
        return None
    if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool) and -(2**63) <= rid < 2**63:
        return rid
    raise bad(
        f"id must be a string of at most {MAX_ID_CHARS} characters, an integer within "
        f"+-2**63 or null, not {_kind(rid)}"
    )


def checked_request(request: dict[str, Any], default_max: int) -> tuple[str, Any, dict[str, Any]]:
    """("prompt" | "messages", the input, sampling keywords) of a request, every field checked
    for type and shape; InvalidRequestError names the first field that is wrong."""
    unknown = [key for key in request if key not in _FIELDS]
    if unknown:
        raise bad(f"unknown field {_shown(unknown[0])}; known: {', '.join(_FIELDS)}")
    if ("prompt" in request) == ("messages" in request):
        raise bad('a request needs "prompt" (a string) or "messages" (a list), one of the two')
    if "prompt" in request:
        kind, value = "prompt", request["prompt"]
        if not isinstance(value, str) or not value:
            raise bad(f"prompt must be a non-empty string, not {_kind(value)}")
    else:
        kind, value = "messages", checked_messages(request["messages"])
    sampling: dict[str, Any] = {"max_new_tokens": default_max, "temperature": 0.0}
    for key, name in _SAMPLING.items():
        if key in request:
            sampling[name] = _checked_sampling(key, request[key])
    if "logit_bias" in request:
        sampling["logit_bias"] = checked_logit_bias(request["logit_bias"])
    return kind, value, sampling


def checked_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad(f"messages must be a non-empty list of objects, not {_kind(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise bad(f'messages[{i}] must be an object with "role" and "content" only')
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise bad(f"messages[{i}].{key} must be a string, not {_kind(m[key])}")
    return messages


def _checked_sampling(key: str, value: Any) -> Any:
    """Types here; ranges are SamplingConfig's (its message names the field too)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key in ("max_tokens", "seed") and not is_int:
        raise bad(f"{key} must be an integer, not {_kind(value)}")
    if key in ("temperature", "top_p") and not (is_int or isinstance(value, float)):
        raise bad(f"{key} must be a number, not {_kind(value)}")
    if key == "stop":
        stops = [value] if isinstance(value, str) else value
        if (
            not isinstance(stops, list)
            or not 0 < len(stops) <= MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)
        ):
            raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOPS}")
        return tuple(stops)
    if key == "response_format" and not isinstance(value, dict):
        raise bad(f"response_format must be an object, not {_kind(value)}")
    return value


def checked_logit_bias(value: Any) -> dict[int, float]:
    """{"token id": bias from -100 to 100}, as the OpenAI API takes it; -100 bans the token."""
    if not isinstance(value, dict):
        raise bad(f'logit_bias must be an object like {{"2": -100}}, not {_kind(value)}')
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not _TOKEN_ID.fullmatch(key):
            raise bad(f"logit_bias key {_shown(key)} is not a token id (digits only)")
        number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not number or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise bad(f"logit_bias[{key}] must be a number from -100 to 100, not {_kind(bias)}")
        out[int(key)] = float("-inf") if bias <= -MAX_BIAS else float(bias)
    return out


def _kind(value: Any) -> str:
    """How a bad value is named in a message: its JSON type, and the value when short."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    name = names.get(type(value), "a number" if isinstance(value, (int, float)) else "null")
    if isinstance(value, (dict, list)) or value is None:
        return name
    shown = _shown(value)
    return f"{name} {shown}" if len(shown) <= 40 else name


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, int) or abs(value) < 10**40 else "(long)"
    return text if len(text) <= 40 else text[:37] + "..."


# -- the service --------------------------------------------------------------------------


class Signals:
    """SIGTERM and SIGINT, as flags. The handler does no I/O (it could interrupt a write in
    progress) and raises nothing (that would land inside the engine, or its teardown)."""

    def __init__(self) -> None:
        self.stopping = False
        self.arrived: list[str] = []  # appended by the handler, logged by the loop
        self.logged = 0

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.arrived.append(signal.Signals(signum).name)
        self.stopping = True

    def log_new(self) -> None:
        """Log the signals that arrived since the last call; the first one stops the service,
        the others change nothing."""
        while self.logged < len(self.arrived):
            action = "stopping" if self.logged == 0 else "already stopping"
            log("signal", signal=self.arrived[self.logged], action=action)
            self.logged += 1

    def install(self) -> int | None:
        """Handle SIGTERM and SIGINT; returns the read end of a pipe that wakes the input wait
        when one arrives (None where select() cannot wait on pipes)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.on_signal)
        if os.name == "nt":
            return None
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        return wake_r


class Service:
    def __init__(self, model: edgeinfer.Model, max_new_tokens: int, signals: Signals) -> None:
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.signals = signals
        self.output_closed = False
        self.tokens_when_stopped: int | None = None

    @property
    def stopping(self) -> bool:
        return self.signals.stopping or self.output_closed

    def handle(self, line: bytes | int) -> None:
        """Answer one input line (or the length of one too long to read)."""
        if isinstance(line, int):
            self.refuse(None, "invalid_json", f"the request line is {line:,} bytes; at most "
                        f"{MAX_LINE_BYTES:,} are accepted")  # fmt: skip
            return
        try:
            request = parse_json(line, what="the request line", max_bytes=MAX_LINE_BYTES)
        except edgeinfer.EdgeInferError as exc:
            self.refuse(None, "invalid_json", str(exc))
            return
        if not isinstance(request, dict):
            self.refuse(None, "InvalidRequestError", "a request must be a JSON object")
            return
        try:
            rid = request_id(request)
        except edgeinfer.EdgeInferError as exc:
            self.refuse(None, type(exc).__name__, str(exc))
            return
        try:
            self._serve(request, rid)
        except edgeinfer.EdgeInferError as exc:
            self.refuse(rid, type(exc).__name__, str(exc))
        except Exception as exc:  # a fault of ours or the engine's: this request only
            self.refuse(rid, "internal_error", f"{type(exc).__name__}: {exc}"[:500])

    def refuse(self, rid: Any, kind: str, message: str) -> None:
        self.answer({"id": rid, "error": {"type": kind, "message": message}})
        log("refused", id=rid, error=message)

    def answer(self, record: dict[str, Any]) -> None:
        if self.output_closed:
            return
        try:
            sys.stdout.buffer.write(encode_answer(record))
            sys.stdout.buffer.flush()
        except (OSError, ValueError) as exc:  # nobody reads the answers: stop
            self.output_closed = True
            log("output_closed", error=str(exc))
            try:  # so that the flush at exit does not fail again
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass

    def _serve(self, request: dict[str, Any], rid: Any) -> None:
        kind, value, sampling = checked_request(request, self.max_new_tokens)
        if kind == "messages":
            stream = self.model.chat(value, stream=True, **sampling)
        else:
            stream = self.model.stream(value, **sampling)
        for _ in self._until_stopped(stream):
            pass
        result = stream.result
        s = result.stats
        record = {
            "id": rid,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "usage": {
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "cached_tokens": s.reused_prompt_tokens,
            },
            "ttft_ms": round(s.ttft_s * 1000, 1),
            "decode_tok_s": round(s.decode_tokens_per_s, 1),
        }
        if result.parsed is not None:
            record["parsed"] = result.parsed
        self.answer(record)
        late: dict[str, int] = {}  # tokens made after the stop was seen ("within a token")
        if self.tokens_when_stopped is not None:
            late["tokens_after_stop"] = s.completion_tokens - self.tokens_when_stopped
        log("answered", id=rid, finish_reason=result.finish_reason, tokens=s.completion_tokens,
            **late)  # fmt: skip

    def _until_stopped(self, stream: edgeinfer.TokenStream) -> Iterator[Any]:
        """The stream's chunks; a stop request ends the reply at its next token (the answer
        is still written, finish_reason "cancelled")."""
        self.tokens_when_stopped = 0 if self.stopping else None
        if self.stopping:
            stream.cancel()
        made = 0
        for chunk in stream:
            made += len(chunk.token_ids)
            if self.stopping:
                if self.tokens_when_stopped is None:
                    self.tokens_when_stopped = made
                stream.cancel()
            self.signals.log_new()
            yield chunk

    def serve_input(self, fd: int, wake: int | None) -> None:
        """Answer lines from ``fd`` until the input ends or a signal asks to stop."""
        reader = LineReader()
        while not self.stopping:
            self.signals.log_new()
            try:
                if not wait_for_input(fd, wake):
                    continue
                chunk = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                continue
            except OSError as exc:
                log("input_failed", error=str(exc))
                return
            lines = reader.feed(chunk) if chunk else reader.finish()
            for line in lines:
                if self.stopping:
                    break
                if isinstance(line, int) or line.strip():
                    self.handle(line)
            if not chunk:
                return  # end of input


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument(
        "--memory-budget",
        help="e.g. 1.5GiB (default: 75%% of RAM, at least 512 MiB left to the OS)",
    )
    parser.add_argument(
        "--prompt-cache",
        metavar="DIR",
        help="keep long prompts' KV in DIR: after a restart they are read back, not computed",
    )
    args = parser.parse_args()
    signals = Signals()
    wake = signals.install()  # before load: a stop during it exits 0 once it is loaded
    log("loading", model=args.model)
    memory = psutil.virtual_memory()
    budget = args.memory_budget or board_budget(memory.total, memory.available)
    try:
        model = edgeinfer.load(
            args.model,
            memory_budget=budget,
            threads=args.threads,
            context_length=args.context_length,
            prompt_cache=args.prompt_cache,
        )
    except edgeinfer.EdgeInferError as exc:
        log("failed", error=str(exc))
        return 1
    service = Service(model, args.max_new_tokens, signals)
    plan = model.info.get("memory_plan") or {}
    log("ready", model=args.model, provider=model.info.get("provider"),
        context=plan.get("context_length"), budget=plan.get("budget"))  # fmt: skip
    with model:
        service.serve_input(sys.stdin.fileno(), wake)
    signals.log_new()
    log("stopped")
    # From here on a signal has nothing left to stop. Python puts the default action (death
    # by that signal) back while it shuts down, unless the signal is ignored: so ignore it.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
