"""The responses ``/v1/responses`` keeps for ``previous_response_id``, in memory, bounded.

What is kept of each response created with ``store`` true (the default, as OpenAI's): its
response object (what ``GET /v1/responses/{id}`` returns) and its conversation as chat
messages — the earlier responses' conversation it continued, its own input (without
``instructions``, which OpenAI does not carry over either) and its output. Nothing is
written to disk; a restart forgets everything.

For how long: at most ``ttl_s`` seconds (an hour by default) after it was made, and only while
it is among the newest ``max_items`` (256) responses whose kept text adds up to at most
``max_chars`` (32 Mi characters); the oldest go first. A response larger than that alone is
not kept. A request naming a response that is not kept (never made, expired, pushed out,
deleted, or made with ``store: false``) is refused with a 400 that says so.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["ResponseStore", "Stored"]

TTL_S = 3600.0
MAX_ITEMS = 256
MAX_CHARS = 32 * 2**20


@dataclass(frozen=True)
class Stored:
    """One kept response: its object and the conversation it ends."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    made: float  # time.monotonic() when it was kept
    chars: int


class ResponseStore:
    """Responses by id, oldest first; every method is safe from any thread."""

    def __init__(
        self, max_items: int = MAX_ITEMS, max_chars: int = MAX_CHARS, ttl_s: float = TTL_S
    ) -> None:
        self.max_items, self.max_chars, self.ttl_s = max_items, max_chars, ttl_s
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, rid: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep ``response`` and its conversation; False when it alone is over the bound."""
        chars = len(json.dumps(response, ensure_ascii=False)) + len(
            json.dumps(messages, ensure_ascii=False)
        )
        if chars > self.max_chars:
            return False
        with self._lock:
            self._drop(rid)
            self._items[rid] = Stored(response, messages, time.monotonic(), chars)
            self._chars += chars
            self._expire()
        return True

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(rid)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _drop(self, rid: str) -> bool:
        gone = self._items.pop(rid, None)
        if gone is not None:
            self._chars -= gone.chars
        return gone is not None

    def _expire(self) -> None:
        """Drop the oldest until within the bounds and the age limit (the lock is held)."""
        oldest = time.monotonic() - self.ttl_s
        while self._items:
            rid, first = next(iter(self._items.items()))
            over = len(self._items) > self.max_items or self._chars > self.max_chars
            if not over and first.made >= oldest:
                return
            self._drop(rid)

    @property
    def terms(self) -> str:
        """What is kept and for how long, for a refusal's message."""
        return (
            f"responses are kept in memory for {self.ttl_s / 60:g} minutes, the newest "
            f"{self.max_items} at most, and only when created with store=true"
        )
