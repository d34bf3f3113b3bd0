"""A streamed reply as server-sent events: ``data: {chunk}`` per piece of text, a usage
chunk when asked for (``stream_options.include_usage``), then ``data: [DONE]``. A generation
that fails mid-stream ends with an error event, since the status line (200) is gone already.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..generation.results import Chunk
from . import wire
from .connection import Connection
from .replies import figures, server_error

__all__ = ["stream"]

logger = logging.getLogger("edgeinfer.serve")

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_DONE = b"data: [DONE]\n\n"


async def stream(conn: Connection, shape: wire.Shape, first: Chunk) -> tuple[int, dict[str, Any]]:
    """Send the job's events from ``first`` on as SSE: (status, figures) for the log."""
    await conn.start(200, _HEADERS)
    opening = shape.opening()
    if opening is not None:
        await _event(conn, opening)
    what, value, calls, sent = "chunk", first, 0, 0
    while True:
        if what == "chunk" and (value.text or value.tool_calls or value.finish_reason):
            event = shape.chunk(value.text, value.finish_reason, value.tool_calls, calls)
            if getattr(shape, "token_bytes", None) is not None:
                event["choices"][0]["logprobs"] = shape.logprobs(value.logprobs, sent)
            await _event(conn, event)
            calls += len(value.tool_calls)
            sent += len(value.text)
        elif what == "end":
            if shape.include_usage:
                await _event(conn, shape.usage_tail(value.stats))
            await conn.body(_DONE, more=False)
            return 200, figures(value, conn.job.tokens_at_cancel)
        elif what == "error":
            logger.error("generation failed: %s", value)
            await _event(conn, server_error(value).body())
            await conn.body(_DONE, more=False)
            return 500, {}
        what, value = await conn.next()


async def _event(conn: Connection, obj: dict[str, Any]) -> None:
    await conn.body(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode(), more=True)
