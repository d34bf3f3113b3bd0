"""``GET`` and ``DELETE /v1/responses/{id}``: a kept response (``response_store``) read back
or forgotten, in OpenAI's shapes; a response not kept is a 404 that says what is kept."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import wire
from .guard import key_matches
from .replies import RequestLine, unauthorized

if TYPE_CHECKING:
    from .endpoints import Context

__all__ = ["one"]


async def one(ctx: Context, request: Request) -> Response:
    line = RequestLine(ctx.access, request.method, request.url.path)
    rid = request.path_params["id"]
    try:
        if ctx.key is not None and not key_matches(request.headers.get("authorization"), ctx.key):
            raise unauthorized()
        kept = ctx.responses.get(rid)
        if kept is None:
            raise wire.WireError(
                404,
                f"no response {wire.shown(rid)} is kept here; {ctx.responses.terms}",
                code="not_found",
            )
    except wire.WireError as exc:
        line(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)
    line(200)
    if request.method == "DELETE":
        ctx.responses.delete(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})
    return JSONResponse(kept.response)
