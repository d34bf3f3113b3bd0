"""One admitted request's two ends: the client's ASGI connection and its job's events.

The client's connection is watched throughout (the ASGI ``http.disconnect`` message),
streamed or not, so that a client that leaves is noticed while its request waits, runs or
is being answered: every read of the job's next event and every send raises ``Gone`` then.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from . import wire
from .jobs import Job

__all__ = ["FINAL", "Connection", "Gone"]

FINAL = ("end", "error", "dropped")  # the kinds of a job's last event


class Gone(Exception):
    """The client's connection is closed."""


class Connection:
    def __init__(self, job: Job, receive: Any, send: Any) -> None:
        self.job = job
        self.started = False  # the status line has been sent
        self.final: tuple[str, Any] | None = None  # the job's last event, once read
        self._send = send
        self._left = asyncio.ensure_future(_until_disconnect(receive))

    def close(self) -> None:
        self._left.cancel()

    async def next(self) -> tuple[str, Any]:
        """The job's next event; Gone when the client leaves first."""
        if self._left.done():
            raise Gone
        if not self.job.events.empty():  # the usual case mid-stream: no task to wait on
            event = self.job.events.get_nowait()
        else:
            event = await self._wait_event()
        if event[0] in FINAL:
            self.final = event
        return event

    async def _wait_event(self) -> tuple[str, Any]:
        get = asyncio.ensure_future(self.job.events.get())
        try:
            await asyncio.wait({get, self._left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():  # the client left (or this task was cancelled)
                get.cancel()
                raise Gone
        return get.result()

    async def error(self, exc: wire.WireError, quiet: bool = False) -> int:
        """Answer with ``exc``'s body; ``quiet``: a client already gone is no error."""
        headers = [(b"retry-after", b"2")] if exc.status == 503 else []
        try:
            return await self.json(exc.status, exc.body(), headers)
        except Gone:
            if not quiet:
                raise
            return exc.status

    async def json(
        self, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
    ) -> int:
        data = json.dumps(body, ensure_ascii=False).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        head += headers or []
        await self.start(status, head)
        await self.body(data, more=False)
        return status

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._out({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True

    async def body(self, data: bytes, more: bool) -> None:
        await self._out({"type": "http.response.body", "body": data, "more_body": more})

    async def _out(self, message: dict[str, Any]) -> None:
        if self._left.done():
            raise Gone
        try:
            await self._send(message)
        except (OSError, RuntimeError) as exc:  # the connection closed under us
            raise Gone from exc


async def _until_disconnect(receive: Any) -> None:
    """Return when the client's connection closes (the body has been read already)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a server that cannot say: the connection counts as gone
        return
