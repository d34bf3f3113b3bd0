"""A streamed ``/v1/responses`` reply: OpenAI's server-sent events, each ``event: TYPE`` with
``data: {"type": TYPE, "sequence_number": n, ...}``, and no ``[DONE]`` (as OpenAI's).

The order: ``response.created``, ``response.in_progress``; for the text,
``response.output_item.added`` (a message), ``response.content_part.added``, one
``response.output_text.delta`` per piece, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; for each tool call,
``response.output_item.added`` (a function_call), ``response.function_call_arguments.delta``
and ``.done``, ``response.output_item.done``; then ``response.completed`` (or
``response.incomplete`` at max_output_tokens, ``response.failed`` when the server shut down
mid-reply) with the whole response. A generation that fails mid-stream ends with an
``error`` event and ``response.failed``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..generation.results import Chunk, GenerationResult
from .connection import Connection
from .replies import figures, server_error
from .response_objects import ResponseShape, call_item, message_item, new_id, text_part

__all__ = ["Events", "stream"]

logger = logging.getLogger("edgeinfer.serve")

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class Events:
    """The events of one response, in order, numbered; no I/O (``stream`` sends them)."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text: list[str] = []  # the open message's pieces
        self.message: str | None = None  # the open message's id
        self.calls: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def opening(self) -> list[dict[str, Any]]:
        first = self.shape.response()
        return [
            self.event("response.created", response=first),
            self.event("response.in_progress", response=first),
        ]

    def chunk(self, chunk: Chunk) -> list[dict[str, Any]]:
        out = []
        if chunk.text:
            out += self._open_message()
            self.text.append(chunk.text)
            where = self._where()
            delta = self.event("response.output_text.delta", **where, delta=chunk.text, logprobs=[])
            out.append(delta)
        for call in chunk.tool_calls:
            out += self._close_message() + self._call(call)
        return out

    def end(self, result: GenerationResult) -> list[dict[str, Any]]:
        out = self._open_message() if not self.output and not self.calls else []
        out += self._close_message()
        text = "".join(
            p["text"] for o in self.output if o["type"] == "message" for p in o["content"]
        )
        final = self.shape.finish(
            self.output, text, result.finish_reason, result.stats, tuple(self.calls)
        )
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        return [*out, self.event(kind.get(final["status"], "response.failed"), response=final)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """A generation that failed mid-stream: its error, and the failed response."""
        final = self.shape.response("failed", self.output)
        final["error"] = {"code": error.get("code") or "server_error", "message": error["message"]}
        return [
            self.event("error", code=final["error"]["code"], message=error["message"], param=None),
            self.event("response.failed", response=final),
        ]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message, "output_index": len(self.output), "content_index": 0}

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message is not None:
            return []
        self.message = new_id("msg")
        item = message_item(self.message, None, "in_progress")
        where = self._where()
        return [
            self.event("response.output_item.added", output_index=len(self.output), item=item),
            self.event("response.content_part.added", **where, part=text_part("")),
        ]

    def _close_message(self) -> list[dict[str, Any]]:
        if self.message is None:
            return []
        text, where = "".join(self.text), self._where()
        item = message_item(self.message, text)
        out = [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=text_part(text)),
            self.event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.message, self.text = None, []
        return out

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fid, index = new_id("fc"), len(self.output)
        item, opened = call_item(fid, call), call_item(fid, call, "in_progress")
        arguments = item["arguments"]
        self.output.append(item)
        self.calls.append(call)
        where = {"item_id": fid, "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=opened),
            self.event("response.function_call_arguments.delta", **where, delta=arguments),
            self.event("response.function_call_arguments.done", **where, arguments=arguments),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


async def stream(
    conn: Connection, shape: ResponseShape, first: Chunk
) -> tuple[int, dict[str, Any]]:
    """Send the job's events from ``first`` on: (status, figures) for the access log."""
    await conn.start(200, _HEADERS)
    events = Events(shape)
    await _send(conn, events.opening())
    what, value = "chunk", first
    while True:
        if what == "chunk":
            await _send(conn, events.chunk(value))
        elif what == "end":
            await _send(conn, events.end(value))
            await conn.body(b"", more=False)
            return 200, figures(value, conn.job.tokens_at_cancel)
        elif what == "error":
            logger.error("generation failed: %s", value)
            await _send(conn, events.failed(server_error(value).body()["error"]))
            await conn.body(b"", more=False)
            return 500, {}
        what, value = await conn.next()


async def _send(conn: Connection, events: list[dict[str, Any]]) -> None:
    if not events:
        return
    data = "".join(
        f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events
    )
    await conn.body(data.encode(), more=True)
