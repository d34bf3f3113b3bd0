"""Incremental detokenization: token pieces in, safe text out.

Contract of the text handed out (each ``push`` result and the final ``finish``):
- it is valid text: bytes of a multi-byte UTF-8 character split across tokens are held until
  the character is complete (an invalid sequence becomes U+FFFD, never a broken chunk); a
  character still incomplete when generation ends (``max_new_tokens`` reached between its
  bytes) is dropped: the text holds only characters the model completed;
- nothing of a stop string is ever handed out: text that might begin a stop string is held
  until it is ruled out, and text from the stop string on is dropped;
- joining every piece handed out equals ``text`` at the end;
- the cost of one push depends on the piece and the stop strings, not on the reply so far.
Special/control tokens are expected to map to ``b""`` in ``token_bytes``.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._pending = ""  # decoded text not yet handed out (a possible stop-string start)
        self._emitted: list[str] = []
        self.stopped = False  # a stop string was found; nothing more will be handed out

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        return "".join(self._emitted)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became safe to hand out (maybe empty)."""
        if self.stopped:
            return ""
        self._pending += self._utf8.decode(self._token_bytes(token_id))
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: flush held text; the bytes of an incomplete character are
        dropped (they are not text yet)."""
        if self.stopped:
            return ""
        self._utf8.reset()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        cut = self._first_stop(pending)
        if cut is not None:
            self.stopped = True
            out, self._pending = pending[:cut], ""
        else:
            hold = 0 if final else self._held_suffix(pending)
            out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        if out:
            self._emitted.append(out)
        return out

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _held_suffix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
