"""The endpoints: small functions taking the server's one frozen ``Context`` and a request.

``chat``, ``completions`` and ``responses`` check the caller's key, read and check the body
(``body.py``, ``wire.py``, ``responses.py``), admit a job (``admission.py``) and return the
reply that follows it (``generation/delivery.py``); a refusal before that is a JSON error with its
status. ``models``, ``model`` and ``health`` describe the server; the last three answer what
Starlette itself refuses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import InvalidRequestError
from ..model import Model
from . import response_stream, streaming, wire
from .admission import Admission, admit, model_activity, model_slots
from .body import ClientLeft, read_json
from .config import ServerConfig
from .delivery import GenerationReply
from .guard import key_bytes, key_matches
from .jobs import Job
from .replies import (
    AccessLog,
    RequestLine,
    invalid,
    no_chat_template,
    not_generative,
    unauthorized,
)
from .response_objects import ResponseShape, new_id
from .response_store import ResponseStore
from .responses import parse_response

__all__ = [
    "Context",
    "chat",
    "completions",
    "crashed",
    "health",
    "model",
    "models",
    "not_found",
    "responses",
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
    responses: ResponseStore  # what previous_response_id finds (response_store.py)

    @classmethod
    def create(cls, model: Model, config: ServerConfig) -> Context:
        key = key_bytes(config.api_key) if config.api_key is not None else None
        access = AccessLog(as_json=config.log_json)
        admission = Admission(config.max_queue, slots=model_slots(model))
        return cls(model, config, admission, access, key, wire.now(), ResponseStore())


async def chat(ctx: Context, request: Request) -> Any:
    return await _generate(ctx, request, "chat")


async def completions(ctx: Context, request: Request) -> Any:
    return await _generate(ctx, request, "completion")


async def responses(ctx: Context, request: Request) -> Any:
    return await _generate(ctx, request, "response")


async def models(ctx: Context, request: Request) -> Response:
    try:
        _authorize(ctx, request)
    except wire.WireError as exc:
        return _error(exc)
    return JSONResponse({"object": "list", "data": [_model_entry(ctx)]})


async def model(ctx: Context, request: Request) -> Response:
    """``GET /v1/models/{id}``: the served model under its name, "default", or any name with
    ``--any-model-name`` (the entry names the served model); 404 otherwise."""
    try:
        _authorize(ctx, request)
        wire.check_model(ctx.config.name, request.path_params["id"], ctx.config.any_model_name)
    except wire.WireError as exc:
        return _error(exc)
    return JSONResponse(_model_entry(ctx))


def _model_entry(ctx: Context) -> dict[str, Any]:
    name = ctx.config.name
    return {"id": name, "object": "model", "created": ctx.started, "owned_by": "edgeinfer"}


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
            "vocab_size": info.get("vocab_size"),  # the ids token-id inputs may hold
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
    """A chat or text completion or a response: the reply that follows its job, or a
    refusal."""
    line = RequestLine(ctx.access, request.method, request.url.path)
    try:
        parsed, shape, job = await _accept(ctx, request, kind)
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
    job.start(f"edgeinfer-{shape.rid}")
    streamer = response_stream.stream if kind == "response" else streaming.stream
    return GenerationReply(job, shape, parsed.stream, replace(line, stream=parsed.stream), streamer)


Parsed = wire.ChatRequest | wire.CompletionRequest


async def _accept(ctx: Context, request: Request, kind: str) -> tuple[Parsed, Any, Job]:
    """The checked request, its reply's shape and its admitted job; WireError,
    InvalidRequestError or ClientLeft when it is refused."""
    _authorize(ctx, request)
    if ctx.model.info.get("kind") == "embedding":
        raise not_generative(ctx.config.name)
    if kind != "completion" and ctx.model.chat_template is None:
        raise no_chat_template(ctx.config.name)
    body = await read_json(request, ctx.config.max_body_bytes)
    defaults = ctx.config.sampling_defaults
    parsed: Parsed
    if kind == "response":
        asked = parse_response(body, ctx.responses, defaults)
        parsed = asked.chat
        shape: Any = ResponseShape(
            new_id("resp"), ctx.config.name, wire.now(), asked.echo, parsed.sampling,
            asked.conversation, ctx.responses if asked.store else None,
        )  # fmt: skip
    else:
        parsed = (wire.parse_chat if kind == "chat" else wire.parse_completion)(body, defaults)
        rid = wire.new_id("chatcmpl" if kind == "chat" else "cmpl")
        shape = wire.Shape(kind, rid, ctx.config.name, wire.now(), parsed.include_usage,
                           _token_bytes(ctx.model, parsed.sampling))  # fmt: skip
    wire.check_model(ctx.config.name, parsed.model, ctx.config.any_model_name)
    try:
        return parsed, shape, admit(ctx.model, parsed, ctx.admission)
    except InvalidRequestError as exc:  # a prompt over the context, a bad setting
        raise invalid(exc, shape.prompt_param, shape.param_names) from None


def _token_bytes(model: Any, sampling: dict[str, Any]) -> Any:
    """A token's UTF-8 text for the reply's logprobs; None when the request asked for none."""
    if sampling.get("top_logprobs") is None:
        return None
    return model.token_bytes


def _authorize(ctx: Context, request: Request) -> None:
    if ctx.key is not None and not key_matches(request.headers.get("authorization"), ctx.key):
        raise unauthorized()


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
