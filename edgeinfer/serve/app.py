"""The server: one model behind OpenAI's endpoints, on Starlette.

Requests take the model in arrival order (the model's own turn queue); past ``max_queue``
waiting requests a new one is answered 503 with Retry-After at once. Generation runs in a
worker thread per request; a streamed reply's chunks reach the event loop through a queue,
and a client that disconnects cancels its generation, which stops within one token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..errors import EdgeInferError, InvalidRequestError, ModelBusyError
from ..generation import GenerationResult, TokenStream
from ..model import Model
from . import wire

__all__ = ["ServerConfig", "create_app"]

logger = logging.getLogger("edgeinfer.serve")
access = logging.getLogger("edgeinfer.serve.access")


@dataclass(frozen=True)
class ServerConfig:
    name: str  # the model id clients name
    api_key: str | None = None
    max_queue: int = 8  # requests waiting for the model beyond the one it serves
    max_body_bytes: int = 4 * 2**20
    cors_origin: str | None = None
    log_json: bool = False
    retry_after_s: int = 2


class _Admission:
    """At most one running request plus ``max_queue`` waiting ones; the streams of the
    admitted requests, so that shutting down can cancel them before the model closes."""

    def __init__(self, max_queue: int) -> None:
        self._limit = max_queue + 1
        self._active = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.streams: set[TokenStream] = set()

    def track(self, stream: TokenStream) -> None:
        with self._lock:
            self.streams.add(stream)

    def release(self, stream: TokenStream) -> None:
        with self._lock:
            self.streams.discard(stream)
        self.leave()

    def drain(self, timeout: float) -> bool:
        """Cancel every admitted request and wait until none runs; False on timeout."""
        with self._lock:
            for stream in self.streams:
                stream.cancel()
            return self._idle.wait_for(lambda: self._active == 0, timeout)

    def enter(self) -> bool:
        with self._lock:
            if self._active >= self._limit:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._active > 0

    @property
    def waiting(self) -> int:
        with self._lock:
            return max(0, self._active - 1)


def create_app(model: Model, config: ServerConfig) -> Any:
    """The ASGI application serving ``model``."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    admission = _Admission(config.max_queue)
    started = wire.now()

    def error(exc: wire.WireError, headers: dict[str, str] | None = None) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else None
        if token is None or not _same(token, config.api_key):
            raise wire.WireError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
                kind="authentication_error",
            )

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise _too_large(config.max_body_bytes)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > config.max_body_bytes:
                raise _too_large(config.max_body_bytes)
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise wire.WireError(400, f"the body is not JSON: {exc}", code="invalid_json") from exc

    def check_model(requested: str | None) -> None:
        if requested is not None and requested not in (config.name, "default"):
            raise wire.WireError(
                404,
                f"model {requested!r} is not served here; this server serves {config.name!r}",
                param="model",
                code="model_not_found",
            )

    async def handle(request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        log: dict[str, Any] = {"method": request.method, "path": request.url.path}
        try:
            authorized(request)
            body = await read_json(request)
            parsed = wire.parse_chat(body) if kind == "chat" else wire.parse_completion(body)
            check_model(parsed.model)
            if not admission.enter():
                raise wire.WireError(
                    503,
                    f"the server is busy ({config.max_queue} requests waiting); retry shortly",
                    code="server_busy",
                    kind="server_error",
                )
            try:
                stream = _open(model, parsed)
            except BaseException:
                admission.leave()
                raise
            admission.track(stream)
        except wire.WireError as exc:
            _log_line(config, log | {"status": exc.status}, t0)
            retry = {"Retry-After": str(config.retry_after_s)} if exc.status == 503 else None
            return error(exc, retry)
        except InvalidRequestError as exc:
            _log_line(config, log | {"status": 400}, t0)
            return error(_invalid(exc))
        rid = wire.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if parsed.stream:
            events = _sse(stream, kind, rid, parsed.include_usage, config, admission, log, t0)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            result = await asyncio.to_thread(_collect, stream, admission)
        except EdgeInferError as exc:
            _log_line(config, log | {"status": 500}, t0)
            return error(_server_error(exc))
        _log_line(config, log | {"status": 200} | _figures(result), t0)
        reason = wire.finish(result.finish_reason)
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": wire.now(),
                "model": config.name,
                "choices": [choice],
                "usage": wire.usage(result.stats),
            }
        )

    async def chat(request: Request) -> Response:
        return await handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    async def models(request: Request) -> Response:
        try:
            authorized(request)
        except wire.WireError as exc:
            return error(exc)
        entry = {"id": config.name, "object": "model", "created": started, "owned_by": "edgeinfer"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(request: Request) -> Response:
        info = model.info
        return JSONResponse(
            {
                "status": "ok",
                "model": config.name,
                "provider": info.get("provider"),
                "context_length": info.get("context_length"),
                "queue": admission.waiting,
                "busy": admission.busy,
                "memory_plan": info.get("memory_plan"),
                "peak_rss_bytes": _peak_rss(),
            }
        )

    async def not_found(request: Request, exc: Exception) -> Response:
        return error(wire.WireError(404, f"no route {request.url.path}", code="not_found"))

    async def crashed(request: Request, exc: Exception) -> Response:
        logger.exception("request to %s failed", request.url.path)
        return error(
            wire.WireError(500, "internal error; see the server's log", kind="server_error")
        )

    async def wrong_method(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 405)
        return error(wire.WireError(status, f"{request.method} is not allowed here"))

    middleware = []
    if config.cors_origin:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=[config.cors_origin],
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        )
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={404: not_found, 405: wrong_method, 500: crashed, Exception: crashed},
    )
    app.state.drain = admission.drain  # cancel what runs before the model is closed
    return app


def _open(model: Model, parsed: wire.ChatRequest | wire.CompletionRequest) -> TokenStream:
    """The request's token stream; InvalidRequestError (a prompt over the context, a bad
    setting) is raised here, before the response starts."""
    if isinstance(parsed, wire.ChatRequest):
        return model.chat(parsed.messages, stream=True, **parsed.sampling)
    return model.stream(parsed.prompt, **parsed.sampling)


def _collect(stream: TokenStream, admission: _Admission) -> GenerationResult:
    try:
        return stream.collect()
    finally:
        admission.release(stream)


async def _sse(
    stream: TokenStream,
    kind: str,
    rid: str,
    include_usage: bool,
    config: ServerConfig,
    admission: _Admission,
    log: dict[str, Any],
    t0: float,
) -> AsyncIterator[str]:
    """Server-sent events of the stream's chunks; the generation runs in a thread and is
    cancelled when the client goes away (this generator is then closed or cancelled)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def put(item: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone: the server is shutting down
            stream.cancel()

    def work() -> None:
        status = 500
        try:
            for chunk in stream:
                put(("chunk", chunk))
            put(("end", stream.result))
            cancelled = stream.result is not None and stream.result.finish_reason == "cancelled"
            status = 499 if cancelled else 200  # 499: the client closed the connection
        except Exception as exc:  # reported to the client as an error event
            put(("error", exc))
        finally:
            admission.release(stream)
            result = stream.result
            figures = _figures(result) if result is not None else {}
            _log_line(config, log | {"status": status, "stream": True} | figures, t0)

    threading.Thread(target=work, name=f"edgeinfer-{rid}", daemon=True).start()
    created = wire.now()
    name = config.name
    make: Callable[[str, str | None], dict[str, Any]]
    if kind == "chat":
        yield _event(
            wire.chat_chunk(rid, name, created, {"role": "assistant", "content": ""}, None)
        )

        def make(text: str, reason: str | None) -> dict[str, Any]:
            delta = {"content": text} if text else {}
            return wire.chat_chunk(rid, name, created, delta, reason)
    else:

        def make(text: str, reason: str | None) -> dict[str, Any]:
            return wire.completion_chunk(rid, name, created, text, reason)

    try:
        while True:
            what, value = await queue.get()
            if what == "chunk":
                if value.text or value.finish_reason is not None:
                    yield _event(make(value.text, value.finish_reason))
            elif what == "end":
                if include_usage:
                    tail = make("", None) | {"choices": [], "usage": wire.usage(value.stats)}
                    yield _event(tail)
                yield "data: [DONE]\n\n"
                return
            else:
                logger.error("generation failed: %s", value)
                yield _event(_server_error(value).body())
                yield "data: [DONE]\n\n"
                return
    finally:  # the client left (cancelled or closed) or the stream ended
        stream.cancel()  # a no-op once the stream has ended


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _invalid(exc: InvalidRequestError) -> wire.WireError:
    text = str(exc)
    if "context holds" in text:
        return wire.WireError(400, text, param="messages", code="context_length_exceeded")
    param = text.split("=", 1)[0] if "=" in text.split(" ", 1)[0] else None
    names = {"max_new_tokens": "max_tokens"}
    return wire.WireError(400, text, param=names.get(param or "", param), code="invalid_value")


def _server_error(exc: BaseException) -> wire.WireError:
    if isinstance(exc, ModelBusyError):
        return wire.WireError(503, str(exc), code="server_busy", kind="server_error")
    message = str(exc) if isinstance(exc, EdgeInferError) else "internal error"
    return wire.WireError(500, message, kind="server_error")


def _too_large(limit: int) -> wire.WireError:
    return wire.WireError(
        413, f"the request body is larger than {limit:,} bytes", code="request_too_large"
    )


def _same(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())


def _figures(result: GenerationResult) -> dict[str, Any]:
    s = result.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "ttft_ms": round(s.ttft_s * 1000, 1),
        "decode_tok_s": round(s.decode_tokens_per_s, 1),
        "finish_reason": result.finish_reason,
    }


def _log_line(config: ServerConfig, fields: dict[str, Any], t0: float) -> None:
    fields = fields | {"ms": round((time.perf_counter() - t0) * 1000, 1)}
    if config.log_json:
        access.info("%s", json.dumps(fields, ensure_ascii=False))
    else:
        access.info("%s", " ".join(f"{k}={v}" for k, v in fields.items()))


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
