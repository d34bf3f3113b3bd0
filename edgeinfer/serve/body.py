"""A request's body: read within the size limit and parsed as JSON with bounds
(``bounded_json``), so a stranger's body costs at most ``max_body_bytes`` and a 400 naming
the field, never a 500."""

from __future__ import annotations

from typing import Any

from ..bounded_json import parse_json
from ..errors import InvalidRequestError
from . import wire
from .replies import too_large

__all__ = ["ClientLeft", "read_json"]


class ClientLeft(Exception):
    """The client closed the connection before its request body was complete."""


async def read_json(request: Any, limit: int) -> Any:
    """The body as JSON, read within ``limit`` bytes and parsed with bounds."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_large(limit)
    except ClientDisconnect as exc:
        raise ClientLeft from exc
    what = "the request body"
    try:
        return parse_json(bytes(body), what=what, error=InvalidRequestError)
    except InvalidRequestError as exc:
        field, found, _ = str(exc).partition(f" in {what} ")  # the message names the field
        param = field if found else None
        raise wire.WireError(400, str(exc), param=param, code="invalid_json") from None
