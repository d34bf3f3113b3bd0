"""A headless service for a Raspberry Pi or a Jetson: requests in as JSON lines on stdin,
answers out as JSON lines on stdout, its own log as JSON lines on stderr. Built only on
edgeinfer's public API; meant to run under systemd (see apps/edgeinfer-device.service).

A request: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [{"role", "content"}]},
optionally with "max_tokens", "temperature", "top_p", "seed", "stop", "response_format" and
"logit_bias" ({"token id": bias}; -100 bans the token).
An answer: {"id", "text", "finish_reason", "usage": {...}, "ttft_ms", "decode_tok_s"}
(plus "parsed" under a JSON response_format), or {"id", "error": {"type", "message"}} for a
request that cannot be served; the service goes on with the next line.

SIGTERM (systemctl stop) or SIGINT ends the reply in progress (its answer is written, with
finish_reason "cancelled") and exits 0.

Memory: unless --memory-budget is given, the budget is 75% of the board's RAM, leaving at
least 512 MiB to the OS, and never more than the RAM available when the service starts.

    echo '{"id": 1, "prompt": "The capital of France is"}' | python apps/device_service.py
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

import psutil

import edgeinfer

OS_RESERVE = 512 * 2**20
SHARE = 0.75
_SAMPLING = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
             "seed": "seed", "stop": "stop", "response_format": "response_format"}  # fmt: skip


def board_budget(total: int, available: int) -> int:
    """75% of the RAM, at least 512 MiB left to the OS, at most what is available."""
    return max(0, min(int(total * SHARE), total - OS_RESERVE, available))


class _Stop(Exception):
    """SIGTERM/SIGINT while waiting for a request."""


def log(event: str, **fields: Any) -> None:
    record = {"time": round(time.time(), 3), "event": event, **fields}
    print(json.dumps(record, ensure_ascii=False), file=sys.stderr, flush=True)


def answer(record: dict[str, Any]) -> None:
    print(json.dumps(record, ensure_ascii=False), flush=True)


class Service:
    def __init__(self, model: edgeinfer.Model, max_new_tokens: int) -> None:
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.stream: Any = None
        self.stopping = False

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        log("signal", signal=signal.Signals(signum).name)
        if self.stream is not None:
            self.stream.cancel()  # the reply ends at its next token; its answer is written
        else:
            raise _Stop

    def handle(self, line: str) -> None:
        try:
            request = json.loads(line)
        except json.JSONDecodeError as exc:
            answer({"id": None, "error": {"type": "invalid_json", "message": str(exc)}})
            return
        rid = request.get("id") if isinstance(request, dict) else None
        try:
            self._serve(request, rid)
        except edgeinfer.EdgeInferError as exc:
            answer({"id": rid, "error": {"type": type(exc).__name__, "message": str(exc)}})
            log("refused", id=rid, error=str(exc))

    def _serve(self, request: Any, rid: Any) -> None:
        if not isinstance(request, dict):
            raise edgeinfer.InvalidRequestError("a request must be a JSON object")
        sampling = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0}
        for key, name in _SAMPLING.items():
            if key in request:
                sampling[name] = request[key]
        if isinstance(request.get("logit_bias"), dict):
            try:
                sampling["logit_bias"] = {
                    int(k): float("-inf") if v <= -100 else float(v)
                    for k, v in request["logit_bias"].items()
                }
            except (TypeError, ValueError) as exc:
                raise edgeinfer.InvalidRequestError(f"logit_bias: {exc}") from exc
        if "messages" in request:
            stream = self.model.chat(request["messages"], stream=True, **sampling)
        elif isinstance(request.get("prompt"), str):
            stream = self.model.stream(request["prompt"], **sampling)
        else:
            raise edgeinfer.InvalidRequestError('a request needs "prompt" or "messages"')
        self.stream = stream
        try:
            for _ in stream:
                pass
        finally:
            self.stream = None
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
        answer(record)
        log("answered", id=rid, finish_reason=result.finish_reason, tokens=s.completion_tokens)


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
    args = parser.parse_args()
    memory = psutil.virtual_memory()
    budget = args.memory_budget or board_budget(memory.total, memory.available)
    try:
        model = edgeinfer.load(
            args.model,
            memory_budget=budget,
            threads=args.threads,
            context_length=args.context_length,
        )
    except edgeinfer.EdgeInferError as exc:
        log("failed", error=str(exc))
        return 1
    service = Service(model, args.max_new_tokens)
    signal.signal(signal.SIGTERM, service.on_signal)
    signal.signal(signal.SIGINT, service.on_signal)
    plan = model.info.get("memory_plan", {})
    log("ready", model=args.model, provider=model.info.get("provider"),
        context=plan.get("context_length"), budget=plan.get("budget"))  # fmt: skip
    with model:
        try:
            while not service.stopping:
                line = sys.stdin.readline()
                if not line:
                    break  # end of input
                if line.strip():
                    service.handle(line)
        except _Stop:
            pass
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
