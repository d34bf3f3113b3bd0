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

A tool-result marker (markers.py: ``<tool_response``, ``</tool_response>``) outside a call
ends the reply the same way, before the marker: nothing from it on is handed out. A reply
that is nothing but such an echo (small models copy the results' wrapper instead of
answering) says so in ``result.tool_call_error``, and the retry asks again for text.

The reply's text is read through ``ReplyText`` (markers.py), which writes out call markers
that the tokenizer holds as textless tokens.

**One retry** (``retry``, a ``retry.RetryPlan``): a reply that failed in one of the ways
retry.py lists is held back from the failure on, generation is stopped as soon as the
failure is known, and the reply is asked again once; the second try's text and calls follow
what the first handed out before it failed.
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..generation.results import Chunk, GenerationResult, GenerationStats, TokenStream
from . import preamble
from .formats import CallFormat
from .markers import ReplyText
from .parse import ToolCallError, calls_of, opener, split_reply
from .retry import CALL, TEXT, RetryPlan
from .spec import Tool

__all__ = ["ToolCallStream"]

logger = logging.getLogger(__name__)

_WHOLE_REPLY_MARKERS = {
    "llama3": ("{", "<|python_tag|>"),
    "mistral": ("[TOOL_CALLS]", "[{"),
}


class ToolCallStream(TokenStream):
    """The stream of ``inner`` (a chat's TokenStream) with calls found and checked.

    ``reply``: how to read the reply's text (default: the chunks' own text); ``cut``: texts
    that end the reply; ``retry``: the one retry (retry.py); ``find_calls``: False under
    tool_choice "none" (only ``cut`` applies)."""

    def __init__(
        self,
        inner: TokenStream,
        tools: Sequence[Tool],
        fmt: CallFormat,
        *,
        reply: ReplyText | None = None,
        cut: Sequence[str] = (),
        retry: RetryPlan | None = None,
        find_calls: bool = True,
    ) -> None:
        super().__init__(iter(()), inner.cancel_event)
        self._inner = inner
        self._tools = tools
        self._fmt = fmt
        self._reply = reply or ReplyText()
        self._cut = tuple(cut)
        self._openers = ("<tool_call>",) if find_calls else ()
        self._plan = retry if find_calls else None
        # a call written outside the format is looked for only where a retry may follow
        self._names = frozenset(t.name for t in tools) if self._plan else frozenset()
        self.retried: str | None = None  # what the second try was forced to (retry.py)
        self.cut_at: str | None = None  # the result marker the reply ended before
        self._spent: GenerationStats | None = None  # the stats of a first try, retried
        self._reset()
        self._calls: list[dict[str, Any]] = []
        self._seen: set[tuple[str, str]] = set()  # (name, canonical arguments) of each call
        self._pending: deque[Chunk] = deque()

    def _reset(self) -> None:
        """The state of one try's scan."""
        self._buffer = ""  # text not handed out yet
        self._space = ""  # whitespace held until text follows (dropped between calls)
        self._in_call = False
        self._mode: str | None = None  # whole-reply formats: "call" or "text" once known
        self._ended = False  # we stopped generation (a repeated call, a result marker)
        self._error: str | None = None
        self._held: str | None = None  # text after a failed call, while a retry may come
        self._want: tuple[str, str | None] | None = None  # the retry a failure asks for
        self._unsent: list[int] = []

    def __next__(self) -> Chunk:
        while not self._pending:
            if self.result is not None:
                raise StopIteration
            self._take(next(self._inner))
        chunk = self._pending.popleft()
        self._parts.append(chunk.text)
        self._ids.extend(chunk.token_ids)
        return chunk

    def cancel(self) -> None:
        self._inner.cancel()

    def close(self) -> None:
        self._inner.close()

    def _take(self, chunk: Chunk) -> None:
        text = self._reply.take(chunk)
        if not self._ended:  # after we stopped it, what the model still wrote is dropped
            self._buffer += text
        self._unsent.extend(chunk.token_ids)
        final = chunk.finish_reason is not None
        text, calls = self._scan(final)
        if not final:
            if text or calls:
                self._emit(Chunk(text, self._ids_out(), tool_calls=tuple(calls)))
            return
        assert chunk.finish_reason is not None and chunk.stats is not None
        asked_to_stop = chunk.finish_reason == "cancelled" and not self._ended  # by the caller
        if self._plan is not None and self._want is not None and not self._calls:
            if not asked_to_stop:
                self._ask_again(chunk.stats)
                return
        self._finish(text + (self._held or ""), calls, chunk)

    def _finish(self, text: str, calls: list[dict[str, Any]], chunk: Chunk) -> None:
        assert chunk.finish_reason is not None and chunk.stats is not None
        reason = chunk.finish_reason
        if self._ended and reason == "cancelled":  # we stopped it, at the end of a call
            reason = "stop"
        if self._calls and self._error is None and reason == "stop":
            reason = "tool_calls"
        stats = _spent(self._spent, chunk.stats)
        self._emit(Chunk(text, self._ids_out(), reason, stats, tuple(calls)))
        self.result = GenerationResult(
            "".join(self._parts) + "".join(c.text for c in self._pending),
            (*self._ids, *(i for c in self._pending for i in c.token_ids)),
            reason,
            stats,
            tool_calls=tuple(self._calls),
            tool_call_error=self._error,
        )

    def _ask_again(self, stats: GenerationStats) -> None:
        """The failed try is dropped and the reply asked again, once (retry.py)."""
        assert self._plan is not None and self._want is not None
        kind, name = self._want
        logger.info("tool_choice auto: %s; asking again (%s %s)", self._error, kind, name or "")
        self._inner, self._reply = self._plan.rerun(kind, name)
        self._plan, self._names, self.retried, self._spent = None, frozenset(), kind, stats
        if kind == TEXT:
            self._openers = ()
        self._reset()

    def _fail(self, why: str, kind: str, name: str | None) -> None:
        """A failure the retry answers: the reply is held from here on."""
        self._error = self._error or why
        if self._plan is not None and not self._calls and self._want is None:
            self._held, self._want = "", (kind, name)

    def _emit(self, chunk: Chunk) -> None:
        self._pending.append(chunk)

    def _ids_out(self) -> tuple[int, ...]:
        ids = tuple(self._unsent)
        self._unsent.clear()
        return ids

    def _scan(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Text that can be handed out now, and calls completed now."""
        if opener(self._fmt) is not None or not self._openers:
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
                self._fail(str(exc), CALL, named_function(raw, self._tools))
                out: list[str] = []
                self._put(out, raw)
                return "".join(out), []
        calls = self._new(calls)
        self._calls += calls
        return "", calls

    def _put(self, out: list[str], text: str) -> None:
        """``text`` handed out, or held after a failed call."""
        if self._held is not None:
            self._held += text
        else:
            out.append(text)

    def _scan_tagged(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        while self._buffer:
            if not self._in_call and not self._text_part(text, final):
                break
            if not self._call_part(text, calls, final):
                break
        if final and self._space and not self._calls:
            self._put(text, self._space)
            self._space = ""
        return "".join(text), calls

    def _text_part(self, text: list[str], final: bool) -> bool:
        """Hand out the text before the next call; True when a call opens in the buffer."""
        markers = (*self._openers, *self._cut)
        at, marker = _first(self._buffer, markers)
        begin, state, name = preamble.find(self._buffer, self._names)
        if begin >= 0 and (at < 0 or begin < at) and (state == preamble.YES or not final):
            self._put(text, self._plain(self._buffer[:begin], True))
            self._buffer = self._buffer[begin:]
            if state == preamble.YES:
                self._outside_call(name or "")
            return False
        if at < 0:
            keep = 0 if final else _held_back(self._buffer, markers)
            cut = len(self._buffer) - keep
            self._put(text, self._plain(self._buffer[:cut], final))
            self._buffer = self._buffer[cut:]
            return False
        # text before a result marker ends the reply: its trailing whitespace is dropped
        self._put(text, self._plain(self._buffer[:at], marker not in self._cut))
        if marker in self._cut:
            self.cut_at = marker
            if not (self._calls or self._buffer[:at].strip() or self._handed_out(text)):
                self._fail("the reply began a tool result instead of an answer", TEXT, None)
            self._end_at_result_marker()
            return False
        self._buffer, self._in_call = self._buffer[at:], True
        return True

    def _outside_call(self, name: str) -> None:
        """A call begun outside the format (preamble.py). Right after the results of a call
        to the same function it restates that call (the Coder models write the call, or the
        call with its result, as JSON instead of answering): asked again for text; any
        other is asked again with the call forced. The reply ends here either way."""
        assert self._plan is not None
        if name in self._plan.answered_names:
            self._fail(f"the reply restated the call to {name} just answered", TEXT, None)
        else:
            self._fail(f"a call to {name} was written outside <tool_call> tags", CALL, name)
        self._held = (self._held or "") + self._buffer
        self._stop_generation("a call began outside the format")

    def _call_part(self, text: list[str], calls: list[dict[str, Any]], final: bool) -> bool:
        """Read the call the buffer opens with, once it is closed (or the reply ended);
        False when the scan is to stop here."""
        close = "</tool_call>"
        end = self._buffer.find(close)
        if end < 0 and not final:
            return False
        stop = len(self._buffer) if end < 0 else end + len(close)
        raw, self._buffer, self._in_call = self._buffer[:stop], self._buffer[stop:], False
        try:
            found = calls_of(raw, self._tools, self._fmt)
        except ToolCallError as exc:
            self._fail(str(exc), CALL, named_function(raw, self._tools))
            self._put(text, self._plain(raw, True))
            return True
        self._space = ""  # whitespace before a call is dropped
        fresh = self._new(found)
        self._calls += fresh
        calls += fresh
        if len(fresh) < len(found):
            self._stop_generation("a tool call repeated an earlier one")
            return False
        return True

    def _new(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``calls`` up to the first that repeats one already made (in this reply)."""
        fresh: list[dict[str, Any]] = []
        for call in calls:
            function = call["function"]
            arguments = json.dumps(json.loads(function["arguments"]), sort_keys=True)
            key = (function["name"], arguments)
            if key in self._seen:
                break
            if self._plan is not None and not self._calls and key in self._plan.answered:
                self._fail(f"the reply repeated the call to {key[0]} just answered", TEXT, None)
                break
            self._seen.add(key)
            fresh.append(call)
        return fresh

    def _handed_out(self, text: list[str]) -> bool:
        """Whether any text of this reply is out (or on its way)."""
        return any(p.strip() for p in (*self._parts, *text, *(c.text for c in self._pending)))

    def _end_at_result_marker(self) -> None:
        self._stop_generation("the reply began a tool result")
        self._space = ""  # whitespace before the marker ends with it

    def _stop_generation(self, why: str) -> None:
        logger.debug("%s: the reply ends there", why)
        self._ended = True
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


_NAME_FIELD = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"')


def named_function(raw: str, tools: Sequence[Tool]) -> str | None:
    """The offered function a failed call's text names first, if any."""
    names = {t.name for t in tools}
    return next((m for m in _NAME_FIELD.findall(raw[:4096]) if m in names), None)


def _spent(first: GenerationStats | None, last: GenerationStats) -> GenerationStats:
    """The stats of a reply that took two tries: tokens and time of both, the first's
    time to first token."""
    if first is None:
        return last
    return replace(
        last,
        completion_tokens=first.completion_tokens + last.completion_tokens,
        ttft_s=first.ttft_s,
        total_s=first.total_s + last.total_s,
    )


def _first(text: str, markers: Sequence[str]) -> tuple[int, str]:
    """Where the first of ``markers`` begins in ``text`` (-1 if none), and which."""
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


def _held_back(text: str, markers: Sequence[str]) -> int:
    """Characters at the end of ``text`` that may begin one of ``markers``."""
    return max((_partial_suffix(text, m) for m in markers), default=0)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
