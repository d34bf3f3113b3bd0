"""The server's ASGI application: routes and middleware, nothing else.

Every request first passes the Host/Origin guard (``guard.py``), then CORS when an origin is
allowed; the endpoints (``endpoints.py``) share one frozen ``Context`` built here.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from ..model import Model
from . import embeddings, endpoints, response_routes
from .config import ServerConfig
from .endpoints import Context
from .guard import HostGuard, allowed_hosts

__all__ = ["create_app"]


def create_app(model: Model, config: ServerConfig) -> Any:
    """The ASGI application serving ``model``; ``app.state.shutdown()`` ends every request
    in flight (called when the server is told to stop), ``app.state.wait_idle(s)`` waits."""
    ctx = Context.create(model, config)
    routes = [
        Route("/v1/chat/completions", partial(endpoints.chat, ctx), methods=["POST"]),
        Route("/v1/completions", partial(endpoints.completions, ctx), methods=["POST"]),
        Route("/v1/responses", partial(endpoints.responses, ctx), methods=["POST"]),
        Route("/v1/responses/{id}", partial(response_routes.one, ctx), methods=["GET", "DELETE"]),
        Route("/v1/embeddings", partial(embeddings.embeddings, ctx), methods=["POST"]),
        Route("/v1/models", partial(endpoints.models, ctx), methods=["GET"]),
        Route("/v1/models/{id:path}", partial(endpoints.model, ctx), methods=["GET"]),
        Route("/health", partial(endpoints.health, ctx), methods=["GET"]),
    ]
    errors = {
        404: endpoints.not_found,
        405: endpoints.wrong_method,
        500: endpoints.crashed,
        Exception: endpoints.crashed,
    }
    app = Starlette(routes=routes, middleware=_middleware(ctx), exception_handlers=errors)
    app.state.shutdown = ctx.admission.shutdown  # end what runs and waits, refuse what comes
    app.state.wait_idle = ctx.admission.wait_idle
    return app


def _middleware(ctx: Context) -> list[Middleware]:
    config = ctx.config
    hosts = allowed_hosts(config.host, config.allow_hosts)
    guard = Middleware(
        HostGuard, hosts=hosts, cors_origin=config.cors_origin, log=ctx.access.refused
    )
    if not config.cors_origin:
        return [guard]
    cors = Middleware(
        CORSMiddleware,
        allow_origins=[config.cors_origin],
        allow_methods=["GET", "POST"],
        allow_headers=["Authorization", "Content-Type"],
    )
    return [guard, cors]
