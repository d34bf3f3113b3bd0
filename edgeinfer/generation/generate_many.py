"""Many requests at once: how ``Model.generate_many`` reads each request, and how it keeps a
window of them running while it collects the results in input order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import InvalidRequestError, short_repr
from .results import GenerationResult, TokenStream

__all__ = ["Request", "collect_in_order", "read_request"]

Request = str | Sequence[int] | Mapping[str, Any]


def read_request(index: int, request: Any) -> tuple[str, Any, dict[str, Any]]:
    """``("prompt", text or ids, sampling)`` or ``("messages", messages, sampling)`` for the
    request at ``index``: a prompt, or a mapping with ``prompt`` or ``messages`` and its own
    sampling fields."""
    if isinstance(request, Mapping):
        fields = dict(request)
        has_prompt, has_messages = "prompt" in fields, "messages" in fields
        if has_prompt == has_messages:
            raise InvalidRequestError(
                f"requests[{index}] needs exactly one of 'prompt' and 'messages'; it has "
                f"{short_repr(sorted(map(str, fields))[:8], 80)}"
            )
        kind = "prompt" if has_prompt else "messages"
        return kind, fields.pop(kind), fields
    if isinstance(request, (str, Sequence)) and not isinstance(request, (bytes, bytearray)):
        return "prompt", request, {}
    raise InvalidRequestError(
        f"requests[{index}] is {type(request).__name__}: expected a prompt (text or token "
        "ids) or a mapping with 'prompt' or 'messages'"
    )


def collect_in_order(
    starters: Sequence[Callable[[], TokenStream]], window: int
) -> list[GenerationResult]:
    """Start up to ``window`` streams ahead of the one being collected; the results in the
    order of ``starters``. Streams still running when a collection fails are closed."""
    results: list[GenerationResult] = []
    running: deque[TokenStream] = deque()
    upcoming = iter(starters)
    try:
        for start in upcoming:
            running.append(start())
            if len(running) >= window:
                break
        while running:
            results.append(running.popleft().collect())
            start = next(upcoming, None)
            if start is not None:
                running.append(start())
    finally:
        for stream in running:
            stream.close()
    return results
