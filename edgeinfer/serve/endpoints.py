"""The endpoints: small functions taking the server's one frozen ``Context`` and a request.

``chat`` and ``completions`` check the caller's key, read and check the body (``body.py``,
``wire.py``), admit a job (``admission.py``) and return the reply that follows it
(``delivery.py``); a refusal before that is a JSON error with its status. ``models`` and
``health`` describe the server; the last three answer what Starlette itself refuses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import InvalidRequestError
from ..model import Model
from . import wire
from .admission import Admission, admit, model_activity, model_slots
from .body import ClientLeft, read_json
from .config import ServerConfig
from .delivery import GenerationReply
from .guard import key_bytes, key_matches
from .jobs import Job
from .replies import AccessLog, RequestLine, invalid, unauthorized

__all__ = [
    "Context",
    "chat",
    "completions",
    "crashed",
    "health",
    "models",
    "not_found",
    "wrong_method",
]

logger = logging.getLogger("edgeinfer.serve")


@dataclass(frozen=True)
class Context:
    """What every endpoint reads; built once by ``create_app``."""

    model: Model
    config: ServerConfig
    admission: Admission  # the queue in front of the model (it changes; the context does not)
    access: AccessLog
    key: bytes | None  # the API key as a client sends it; None: no key needed
    started: int  # when the server started, Unix seconds ("created" of /v1/models)

    @classmethod
    def create(cls, model: Model, config: ServerConfig) -> Context:
        key = key_bytes(config.api_key) if config.api_key is not None else None
        access = AccessLog(as_json=config.log_json)
        admission = Admission(config.max_queue, slots=model_slots(model))
        return cls(model, config, admission, access, key, wire.now())


async def chat(ctx: Context, request: Request) -> Any:
    return await _generate(ctx, request, "chat")


async def completions(ctx: Context, request: Request) -> Any:
    return await _generate(ctx, request, "completion")


async def models(ctx: Context, request: Request) -> Response:
    try:
        _authorize(ctx, request)
    except wire.WireError as exc:
        return _error(exc)
    name = ctx.config.name
    entry = {"id": name, "object": "model", "created": ctx.started, "owned_by": "edgeinfer"}
    return JSONResponse({"object": "list", "data": [entry]})


async def health(ctx: Context, request: Request) -> Response:
    """The model, its memory, and its load: ``activity`` is ``{"slots", "busy", "queued"}``
    (sequence slots, slots running a request, requests waiting for one); ``queue`` repeats
    the waiting count and ``busy`` says whether any request is admitted at all."""
    info = ctx.model.info
    activity = model_activity(ctx.model, ctx.admission)
    return JSONResponse(
        {
            "status": "ok",
            "model": ctx.config.name,
            "provider": info.get("provider"),
            "context_length": info.get("context_length"),
            "queue": activity["queued"],
            "busy": ctx.admission.busy,
            "activity": activity,
            "memory_plan": info.get("memory_plan"),
            "peak_rss_bytes": _peak_rss(),
        }
    )


async def not_found(request: Request, exc: Exception) -> Response:
    return _error(wire.WireError(404, f"no route {request.url.path}", code="not_found"))


async def wrong_method(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 405)
    return _error(wire.WireError(status, f"{request.method} is not allowed here"))


async def crashed(request: Request, exc: Exception) -> Response:
    logger.exception("request to %s failed", request.url.path)
    return _error(wire.WireError(500, "internal error; see the server's log", kind="server_error"))


# -- generation -------------------------------------------------------------------------------


async def _generate(ctx: Context, request: Request, kind: str) -> Any:
    """A chat or text completion: the reply that follows its job, or a refusal."""
    line = RequestLine(ctx.access, request.method, request.url.path)
    try:
        parsed, job = await _accept(ctx, request, kind)
    except wire.WireError as exc:
        line(exc.status)
        retry = {"Retry-After": str(ctx.config.retry_after_s)} if exc.status == 503 else None
        return _error(exc, retry)
    except InvalidRequestError as exc:
        line(400)
        return _error(invalid(exc))
    except ClientLeft:
        line(499)
        return _Nothing()
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    shape = wire.Shape(kind, wire.new_id(prefix), ctx.config.name, wire.now(), parsed.include_usage)
    job.start(f"edgeinfer-{shape.rid}")
    return GenerationReply(job, shape, parsed.stream, replace(line, stream=parsed.stream))


async def _accept(
    ctx: Context, request: Request, kind: str
) -> tuple[wire.ChatRequest | wire.CompletionRequest, Job]:
    """The checked request and its admitted job; WireError, InvalidRequestError or
    ClientLeft when it is refused."""
    _authorize(ctx, request)
    body = await read_json(request, ctx.config.max_body_bytes)
    defaults = ctx.config.sampling_defaults
    parse = wire.parse_chat if kind == "chat" else wire.parse_completion
    parsed = parse(body, defaults)
    if not ctx.config.any_model_name:
        _check_model(ctx.config.name, parsed.model)
    return parsed, admit(ctx.model, parsed, ctx.admission)


def _authorize(ctx: Context, request: Request) -> None:
    if ctx.key is not None and not key_matches(request.headers.get("authorization"), ctx.key):
        raise unauthorized()


def _check_model(name: str, requested: str | None) -> None:
    if requested is not None and requested not in (name, "default"):
        raise wire.WireError(
            404,
            f"model {wire.shown(requested)} is not served here; this server serves {name!r} "
            "(start it with --any-model-name to answer every model name with it)",
            param="model",
            code="model_not_found",
        )


def _error(exc: wire.WireError, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class _Nothing:
    """The reply to a client that has gone: nothing to send (uvicorn expects no response
    from a request whose connection is closed)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        return None


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
