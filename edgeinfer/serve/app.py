"""The server: one model behind OpenAI's endpoints, on Starlette.

Requests take the model in arrival order; past ``max_queue`` waiting requests a new one is
answered 503 with Retry-After at once. Each admitted request is a job (``jobs.py``) whose
generation runs in a worker thread; its reply (``reply.py``) follows the job, cancels it
when the client leaves, and answers 503 when the server shuts down before it could finish.
Every request first passes the Host/Origin guard (``guard.py``) against DNS rebinding and
cross-site pages. Bodies are parsed with bounds (``bounded_json``) and checked field by field
(``wire.py``): a body from a stranger gets a 4xx naming the field, never a 500.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from ..bounded_json import parse_json
from ..errors import InvalidRequestError
from ..model import Model
from . import wire
from .guard import HostGuard, allowed_hosts, key_bytes, key_matches
from .jobs import Admission, Job
from .reply import GenerationReply, invalid, shutting_down

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
    host: str = "127.0.0.1"  # the bound address: a name requests may give as their Host
    allow_hosts: tuple[str, ...] = ()  # more such names (--allow-host)


def create_app(model: Model, config: ServerConfig) -> Any:
    """The ASGI application serving ``model``; ``app.state.shutdown()`` ends every request
    in flight (called when the server is told to stop), ``app.state.wait_idle(s)`` waits."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    admission = Admission(config.max_queue)
    started = wire.now()
    key = key_bytes(config.api_key) if config.api_key is not None else None

    def error(exc: wire.WireError, headers: dict[str, str] | None = None) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def authorized(request: Request) -> None:
        if key is not None and not key_matches(request.headers.get("authorization"), key):
            raise wire.WireError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
                kind="authentication_error",
            )

    async def handle(request: Request, kind: str) -> Any:
        t0 = time.perf_counter()
        log: dict[str, Any] = {"method": request.method, "path": request.url.path}
        try:
            authorized(request)
            body = await _read_json(request, config.max_body_bytes)
            parsed = wire.parse_chat(body) if kind == "chat" else wire.parse_completion(body)
            _check_model(config.name, parsed.model)
            job = _admit(model, parsed, admission, config.max_queue)
        except wire.WireError as exc:
            _log_line(config, log | {"status": exc.status}, t0)
            retry = {"Retry-After": str(config.retry_after_s)} if exc.status == 503 else None
            return error(exc, retry)
        except InvalidRequestError as exc:
            _log_line(config, log | {"status": 400}, t0)
            return error(invalid(exc))
        except _ClientLeft:
            _log_line(config, log | {"status": 499}, t0)
            return _Nothing()
        shape = wire.Shape(
            kind,
            wire.new_id("chatcmpl" if kind == "chat" else "cmpl"),
            config.name,
            wire.now(),
            parsed.include_usage,
        )
        if parsed.stream:
            log["stream"] = True

        def write(status: int, figures: dict[str, Any]) -> None:
            _log_line(config, log | {"status": status} | figures, t0)

        job.start(f"edgeinfer-{shape.rid}")
        return GenerationReply(job, shape, parsed.stream, write)

    async def chat(request: Request) -> Any:
        return await handle(request, "chat")

    async def completions(request: Request) -> Any:
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

    def refused(fields: dict[str, Any], status: int) -> None:
        _log_line(config, fields, time.perf_counter())

    hosts = allowed_hosts(config.host, config.allow_hosts)
    middleware = [Middleware(HostGuard, hosts=hosts, cors_origin=config.cors_origin, log=refused)]
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
    app.state.shutdown = admission.shutdown  # end what runs and waits, refuse what comes
    app.state.wait_idle = admission.wait_idle
    return app


class _ClientLeft(Exception):
    """The client closed the connection before its request body was complete."""


class _Nothing:
    """The reply to a client that has gone: nothing to send (uvicorn expects no response
    from a request whose connection is closed)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        return None


async def _read_json(request: Any, limit: int) -> Any:
    """The body as JSON, read within ``limit`` bytes and parsed with bounds."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect as exc:
        raise _ClientLeft from exc
    what = "the request body"
    try:
        return parse_json(bytes(body), what=what, error=InvalidRequestError)
    except InvalidRequestError as exc:
        field, found, _ = str(exc).partition(f" in {what} ")  # the message names the field
        param = field if found else None
        raise wire.WireError(400, str(exc), param=param, code="invalid_json") from None


def _check_model(name: str, requested: str | None) -> None:
    if requested is not None and requested not in (name, "default"):
        raise wire.WireError(
            404,
            f"model {wire.shown(requested)} is not served here; this server serves {name!r}",
            param="model",
            code="model_not_found",
        )


def _admit(
    model: Model,
    parsed: wire.ChatRequest | wire.CompletionRequest,
    admission: Admission,
    limit: int,
) -> Job:
    """The request's job, admitted into the queue; InvalidRequestError (a prompt over the
    context, a bad setting) is raised here, before the response starts."""
    if admission.closing:
        raise shutting_down()
    if isinstance(parsed, wire.ChatRequest):
        stream = model.chat(parsed.messages, stream=True, **parsed.sampling)
    else:
        stream = model.stream(parsed.prompt, **parsed.sampling)
    job = Job(stream, admission)
    if admission.enter(job):
        return job
    if admission.closing:
        raise shutting_down()
    raise wire.WireError(
        503,
        f"the server is busy ({limit} requests waiting); retry shortly",
        code="server_busy",
        kind="server_error",
    )


def _too_large(limit: int) -> wire.WireError:
    return wire.WireError(
        413, f"the request body is larger than {limit:,} bytes", code="request_too_large"
    )


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
