"""The reply to an admitted request: an ASGI response that follows its job to the end.

The status line is sent only once the model has produced something, so a request that ends
before that gets an honest status: 503 when the server shut down, 400 or 500 when the
request failed, nothing (499 in the log) when the client left. A client that leaves
(``connection.Gone``) cancels its generation, which stops within one token and frees the
model. Whole replies are sent from here, streamed ones by ``streaming.stream``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import InvalidRequestError
from ..generation.results import GenerationResult
from .connection import FINAL, Connection, Gone
from .jobs import Job
from .replies import figures, invalid, server_error, shutting_down
from .streaming import stream

__all__ = ["GenerationReply"]

logger = logging.getLogger("edgeinfer.serve")

Log = Callable[[int, dict[str, Any]], None]  # (status, figures) -> one access line
Outcome = tuple[int, dict[str, Any]]  # (status, figures) for the access line
# sends a streamed reply from its first chunk on: streaming.stream (chat, completions) or
# response_stream.stream (/v1/responses)
Streamer = Callable[[Connection, Any, Any], Awaitable[Outcome]]


class GenerationReply:
    """``shape`` builds the reply's objects (``wire.Shape``, ``response_objects.ResponseShape``):
    ``whole(text, reason, stats, tool_calls)``, ``prompt_param`` and ``param_names``."""

    def __init__(
        self, job: Job, shape: Any, streamed: bool, log: Log, streamer: Streamer = stream
    ) -> None:
        self.job, self.shape, self.streamed, self.log = job, shape, streamed, log
        self.streamer = streamer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        conn = Connection(self.job, receive, send)
        status, figs = 500, {}
        try:
            try:
                status, figs = await self._run(conn)
            except Gone:
                status, figs = await _client_left(conn)
        except asyncio.CancelledError:  # the server stopped waiting for it (shutdown timeout)
            self.job.cancel("shutdown")
            status = 503
            if not conn.started:
                await conn.error(shutting_down(), quiet=True)
        except Exception:  # a bug of ours: logged with its traceback, the client gets a 500
            logger.exception("the reply to %s failed", scope.get("path"))
            status = 500
            if not conn.started:
                await conn.error(server_error(RuntimeError()), quiet=True)
        finally:
            conn.close()
            self.job.cancel("client")  # a no-op once the job has ended
        self.log(status, figs)

    async def _run(self, conn: Connection) -> Outcome:
        what, value = await conn.next()
        if what == "dropped":  # cancelled before its turn came
            if self.job.why == "client":
                raise Gone
            return await conn.error(shutting_down()), {}
        if what == "error":
            return await _failed(conn, value, self.shape), {}
        if self.streamed and not self._ended_by_shutdown(value):
            return await self.streamer(conn, self.shape, value)
        return await self._whole(conn, value)

    def _ended_by_shutdown(self, chunk: Any) -> bool:
        """A first chunk that is also the last, cut by a shutdown: nothing was generated."""
        return chunk.finish_reason == "cancelled" and self.job.why == "shutdown"

    async def _whole(self, conn: Connection, first: Any) -> Outcome:
        """The reply as one JSON object, once the job has ended."""
        what, value, parts = "chunk", first, [first.text]
        while what != "end":
            what, value = await conn.next()
            if what == "error":
                return await _failed(conn, value, self.shape), {}
            if what == "chunk":
                parts.append(value.text)
        result: GenerationResult = value
        figs = figures(result, self.job.tokens_at_cancel)
        if result.finish_reason == "cancelled":  # by a shutdown: the client is still here
            return await conn.error(shutting_down()), figs
        body = self.shape.whole(
            "".join(parts), result.finish_reason, result.stats, result.tool_calls,
            result.logprobs,
        )  # fmt: skip
        return await conn.json(200, body), figs


async def _client_left(conn: Connection) -> Outcome:
    """Cancel the job and wait for its end (within one token) for the log's figures."""
    conn.job.cancel("client")
    while conn.final is None:
        event = await conn.job.events.get()
        conn.final = event if event[0] in FINAL else None
    what, value = conn.final
    return 499, (figures(value, conn.job.tokens_at_cancel) if what == "end" else {})


async def _failed(conn: Connection, exc: BaseException, shape: Any) -> int:
    if isinstance(exc, InvalidRequestError):
        return await conn.error(invalid(exc, shape.prompt_param, shape.param_names))
    logger.error("generation failed: %s", exc)
    return await conn.error(server_error(exc))
