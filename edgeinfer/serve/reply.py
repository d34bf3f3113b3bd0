"""The reply to an admitted request: an ASGI response that follows its job to the end.

The status line is sent only once the model has produced something, so a request that ends
before that gets an honest status: 503 when the server shut down, 400 or 500 when the
request failed, nothing (499 in the log) when the client left. Throughout, the client's
connection is watched (the ASGI ``http.disconnect`` message), streamed or not: a client that
leaves cancels its generation, which stops within one token and frees the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from ..errors import EdgeInferError, InvalidRequestError, ModelBusyError
from ..generation import GenerationResult
from . import wire
from .jobs import Job

__all__ = ["GenerationReply", "invalid", "server_error", "shutting_down"]

logger = logging.getLogger("edgeinfer.serve")

Log = Callable[[int, dict[str, Any]], None]  # (status, figures) -> one access line
_FINAL = ("end", "error", "dropped")


class _Gone(Exception):
    """The client's connection is closed."""


class GenerationReply:
    def __init__(self, job: Job, shape: wire.Shape, streamed: bool, log: Log) -> None:
        self.job, self.shape, self.streamed, self.log = job, shape, streamed, log
        self.started = False  # the status line has been sent
        self._send: Any = None
        self._left: asyncio.Future[None] | None = None
        self._final: tuple[str, Any] | None = None  # the job's last event, once read

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self._send = send
        self._left = asyncio.ensure_future(_until_disconnect(receive))
        status, figures = 500, {}
        try:
            try:
                status, figures = await self._run()
            except _Gone:
                status, figures = await self._client_left()
        except asyncio.CancelledError:  # the server stopped waiting for it (shutdown timeout)
            self.job.cancel("shutdown")
            status = 503
            if not self.started:
                await self._json(shutting_down(), quiet=True)
        except Exception:  # a bug of ours: logged with its traceback, the client gets a 500
            logger.exception("the reply to %s failed", scope.get("path"))
            status = 500
            if not self.started:
                await self._json(server_error(RuntimeError()), quiet=True)
        finally:
            self._left.cancel()
            self.job.cancel("client")  # a no-op once the job has ended
        self.log(status, figures)

    async def _next(self) -> tuple[str, Any]:
        """The job's next event; _Gone when the client leaves first."""
        assert self._left is not None
        if self._left.done():
            raise _Gone
        if not self.job.events.empty():  # the usual case mid-stream: no task to wait on
            event = self.job.events.get_nowait()
        else:
            event = await self._wait_event()
        if event[0] in _FINAL:
            self._final = event
        return event

    async def _wait_event(self) -> tuple[str, Any]:
        assert self._left is not None
        get = asyncio.ensure_future(self.job.events.get())
        try:
            await asyncio.wait({get, self._left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():  # the client left (or this task was cancelled)
                get.cancel()
                raise _Gone
        return get.result()

    async def _run(self) -> tuple[int, dict[str, Any]]:
        what, value = await self._next()
        if what == "dropped":  # cancelled before its turn came
            if self.job.why == "client":
                raise _Gone
            return await self._json(shutting_down()), {}
        if what == "error":
            return await self._failed(value), {}
        if self.streamed and not self._ended_by_shutdown(value):
            return await self._stream(value)
        parts = [value.text]
        while what != "end":
            what, value = await self._next()
            if what == "error":
                return await self._failed(value), {}
            if what == "chunk":
                parts.append(value.text)
        result: GenerationResult = value
        if result.finish_reason == "cancelled":  # by a shutdown: the client is still here
            return await self._json(shutting_down()), _figures(result, self.job)
        body = self.shape.whole("".join(parts), result.finish_reason, result.stats)
        return await self._send_json(200, body), _figures(result, self.job)

    def _ended_by_shutdown(self, chunk: Any) -> bool:
        """A first chunk that is also the last, cut by a shutdown: nothing was generated."""
        return chunk.finish_reason == "cancelled" and self.job.why == "shutdown"

    async def _stream(self, first: Any) -> tuple[int, dict[str, Any]]:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        await self._out({"type": "http.response.start", "status": 200, "headers": headers})
        opening = self.shape.opening()
        if opening is not None:
            await self._event(opening)
        what, value = "chunk", first
        while True:
            if what == "chunk" and (value.text or value.finish_reason is not None):
                await self._event(self.shape.chunk(value.text, value.finish_reason))
            elif what == "end":
                if self.shape.include_usage:
                    await self._event(self.shape.usage_tail(value.stats))
                await self._body(b"data: [DONE]\n\n", more=False)
                return 200, _figures(value, self.job)
            elif what == "error":
                logger.error("generation failed: %s", value)
                await self._event(server_error(value).body())
                await self._body(b"data: [DONE]\n\n", more=False)
                return 500, {}
            what, value = await self._next()

    async def _client_left(self) -> tuple[int, dict[str, Any]]:
        """Cancel the job and wait for its end (within one token) for the log's figures."""
        self.job.cancel("client")
        while self._final is None:
            event = await self.job.events.get()
            self._final = event if event[0] in _FINAL else None
        what, value = self._final
        return 499, (_figures(value, self.job) if what == "end" else {})

    async def _failed(self, exc: BaseException) -> int:
        if isinstance(exc, InvalidRequestError):
            return await self._json(invalid(exc))
        logger.error("generation failed: %s", exc)
        return await self._json(server_error(exc))

    async def _json(self, exc: wire.WireError, quiet: bool = False) -> int:
        headers = [(b"retry-after", b"2")] if exc.status == 503 else []
        try:
            return await self._send_json(exc.status, exc.body(), headers)
        except _Gone:
            if not quiet:
                raise
            return exc.status

    async def _send_json(
        self, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
    ) -> int:
        data = json.dumps(body, ensure_ascii=False).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        head += headers or []
        await self._out({"type": "http.response.start", "status": status, "headers": head})
        await self._body(data, more=False)
        return status

    async def _event(self, obj: dict[str, Any]) -> None:
        await self._body(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode(), more=True)

    async def _body(self, data: bytes, more: bool) -> None:
        await self._out({"type": "http.response.body", "body": data, "more_body": more})

    async def _out(self, message: dict[str, Any]) -> None:
        if self._left is not None and self._left.done():
            raise _Gone
        try:
            await self._send(message)
        except (OSError, RuntimeError) as exc:  # the connection closed under us
            raise _Gone from exc
        if message["type"] == "http.response.start":
            self.started = True


async def _until_disconnect(receive: Any) -> None:
    """Return when the client's connection closes (the body has been read already)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a server that cannot say: the connection counts as gone
        return


def _figures(result: GenerationResult | None, job: Job) -> dict[str, Any]:
    if result is None:
        return {}
    s = result.stats
    figures = {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "ttft_ms": round(s.ttft_s * 1000, 1),
        "decode_tok_s": round(s.decode_tokens_per_s, 1),
        "finish_reason": result.finish_reason,
    }
    if job.tokens_at_cancel is not None and result.finish_reason == "cancelled":
        # how far generation ran after the cancel was seen: what a late cancel costs
        figures["tokens_after_cancel"] = s.completion_tokens - job.tokens_at_cancel
    return figures


def invalid(exc: InvalidRequestError) -> wire.WireError:
    text = str(exc)
    if "context holds" in text:
        return wire.WireError(400, text, param="messages", code="context_length_exceeded")
    first = text.split(" ", 1)[0].split("=", 1)[0]  # messages start with the setting's name
    param = _PARAMS.get(first, first if first in _PARAMS.values() else None)
    return wire.WireError(400, text, param=param, code="invalid_value")


# edgeinfer's sampling names as the request's fields
_PARAMS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "logit_bias": "logit_bias",
    "response_format": "response_format",
}


def server_error(exc: BaseException) -> wire.WireError:
    if isinstance(exc, ModelBusyError):
        return wire.WireError(503, str(exc), code="server_busy", kind="server_error")
    message = str(exc) if isinstance(exc, EdgeInferError) else "internal error"
    return wire.WireError(500, message, kind="server_error")


def shutting_down() -> wire.WireError:
    return wire.WireError(
        503,
        "the server is shutting down; the request was not completed, retry it later",
        code="server_shutting_down",
        kind="server_error",
    )
