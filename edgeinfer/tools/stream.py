"""A chat's stream with tools: text passes through as it comes, call markup is held back, and
each call is handed out in a chunk of its own once it is complete and checked.

For tagged formats (``<tool_call>...</tool_call>``: hermes, generic) a call may follow text;
text that could be the start of ``<tool_call>`` is held until it is clear. For formats whose
calls are the whole reply (llama3, mistral) the reply's first characters decide: a reply
that starts as a call is held to its end and parsed then.

A call that fails its check is released as plain text and its reason ends up in
``result.tool_call_error``; the finish reason is then the model's own ("stop", "length"),
never "tool_calls". Whitespace between calls is dropped.

A call identical to one the reply already holds (same name, same arguments) ends the reply:
a greedy model that has made its call tends to repeat it until the length limit. The repeat
is dropped, generation is stopped there, and the reply finishes "tool_calls" with the calls
before it. (The forcing grammar also bounds a reply's calls, formats.MAX_PARALLEL_CALLS.)
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..generation import Chunk, GenerationResult, TokenStream
from .formats import CallFormat
from .parse import ToolCallError, calls_of, opener, split_reply
from .spec import Tool

__all__ = ["ToolCallStream"]

logger = logging.getLogger(__name__)

_WHOLE_REPLY_MARKERS = {
    "llama3": ("{", "<|python_tag|>"),
    "mistral": ("[TOOL_CALLS]", "[{"),
}


class ToolCallStream(TokenStream):
    """The stream of ``inner`` (a chat's TokenStream) with calls found and checked."""

    def __init__(self, inner: TokenStream, tools: Sequence[Tool], fmt: CallFormat) -> None:
        super().__init__(iter(()), inner._cancel)
        self._inner = inner
        self._tools = tools
        self._fmt = fmt
        self._buffer = ""  # text not handed out yet
        self._space = ""  # whitespace held until text follows (dropped between calls)
        self._in_call = False
        self._mode: str | None = None  # whole-reply formats: "call" or "text" once known
        self._calls: list[dict[str, Any]] = []
        self._seen: set[tuple[str, str]] = set()  # (name, canonical arguments) of each call
        self._repeated = False  # a repeated call ended the reply; generation was stopped
        self._error: str | None = None
        self._unsent: list[int] = []
        self._pending: deque[Chunk] = deque()

    def __next__(self) -> Chunk:
        while not self._pending:
            if self.result is not None:
                raise StopIteration
            self._take(next(self._inner))
        chunk = self._pending.popleft()
        self._parts.append(chunk.text)
        self._ids.extend(chunk.token_ids)
        return chunk

    def close(self) -> None:
        self._inner.close()

    def _take(self, chunk: Chunk) -> None:
        if not self._repeated:  # after a repeat, what the model still wrote is dropped
            self._buffer += chunk.text
        self._unsent.extend(chunk.token_ids)
        final = chunk.finish_reason is not None
        text, calls = self._scan(final)
        if not final:
            if text or calls:
                self._emit(Chunk(text, self._ids_out(), tool_calls=tuple(calls)))
            return
        assert chunk.finish_reason is not None and chunk.stats is not None
        reason = chunk.finish_reason
        if self._repeated and reason == "cancelled":  # we stopped it, at the end of a call
            reason = "stop"
        if self._calls and self._error is None and reason == "stop":
            reason = "tool_calls"
        last = Chunk(text, self._ids_out(), reason, chunk.stats, tuple(calls))
        self._emit(last)
        self.result = GenerationResult(
            "".join(self._parts) + "".join(c.text for c in self._pending),
            (*self._ids, *(i for c in self._pending for i in c.token_ids)),
            reason,
            chunk.stats,
            tool_calls=tuple(self._calls),
            tool_call_error=self._error,
        )

    def _emit(self, chunk: Chunk) -> None:
        self._pending.append(chunk)

    def _ids_out(self) -> tuple[int, ...]:
        ids = tuple(self._unsent)
        self._unsent.clear()
        return ids

    def _scan(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Text that can be handed out now, and calls completed now."""
        if opener(self._fmt) is not None:
            return self._scan_tagged(final)
        return self._scan_whole(final)

    def _scan_whole(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self._mode is None:
            head = self._buffer.lstrip()
            markers = _WHOLE_REPLY_MARKERS[self._fmt.name]
            if any(head.startswith(m) for m in markers):
                self._mode = "call"
            elif head and not any(m.startswith(head) for m in markers):
                self._mode = "text"
            elif not final:
                return "", []
        if self._mode != "call":
            text, self._buffer = self._buffer, ""
            return text, []
        if not final:
            return "", []
        raw, self._buffer = self._buffer, ""
        calls: list[dict[str, Any]] = []
        for piece in split_reply(raw, self._fmt):
            try:
                calls += calls_of(piece.text, self._tools, self._fmt)
            except ToolCallError as exc:
                self._error = str(exc)
                return raw, []
        calls = self._new(calls)
        self._calls += calls
        return "", calls

    def _scan_tagged(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        start, close = "<tool_call>", "</tool_call>"
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        while self._buffer:
            if not self._in_call:
                at = self._buffer.find(start)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, start)
                    cut = len(self._buffer) - keep
                    text.append(self._plain(self._buffer[:cut], final))
                    self._buffer = self._buffer[cut:]
                    break
                text.append(self._plain(self._buffer[:at], True))
                self._buffer, self._in_call = self._buffer[at:], True
            end = self._buffer.find(close)
            if end < 0 and not final:
                break
            stop = len(self._buffer) if end < 0 else end + len(close)
            raw, self._buffer, self._in_call = self._buffer[:stop], self._buffer[stop:], False
            try:
                found = calls_of(raw, self._tools, self._fmt)
            except ToolCallError as exc:
                self._error = self._error or str(exc)
                text.append(self._plain(raw, True))
                continue
            self._space = ""  # whitespace before a call is dropped
            fresh = self._new(found)
            self._calls += fresh
            calls += fresh
            if len(fresh) < len(found):
                self._stop_repeating()
                break
        if final and self._space and not self._calls:
            text.append(self._space)
        return "".join(text), calls

    def _new(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``calls`` up to the first that repeats one already made (in this reply)."""
        fresh: list[dict[str, Any]] = []
        for call in calls:
            function = call["function"]
            arguments = json.dumps(json.loads(function["arguments"]), sort_keys=True)
            key = (function["name"], arguments)
            if key in self._seen:
                break
            self._seen.add(key)
            fresh.append(call)
        return fresh

    def _stop_repeating(self) -> None:
        logger.debug("a tool call repeated an earlier one: the reply ends before it")
        self._repeated = True
        self._buffer, self._in_call = "", False
        self._inner.cancel()

    def _plain(self, text: str, settled: bool) -> str:
        """``text`` to hand out, with whitespace held while a call may follow it."""
        if not text.strip():
            self._space += text
            return ""
        out = self._space + text
        self._space = ""
        stripped = out.rstrip()
        if not settled and stripped != out:
            self._space = out[len(stripped) :]
            return stripped
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
