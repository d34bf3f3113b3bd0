"""OpenAI's ``logprobs`` on chat and text completions: the request's fields read, and the
generated tokens' log-probabilities (``GenerationResult.logprobs``) written in each API's
shape.

Chat takes ``logprobs: true`` and ``top_logprobs: 0..20`` and answers
``choices[0].logprobs.content``: one object per token with its text, log-probability, UTF-8
bytes and the likeliest alternatives. Text completions take ``logprobs: 0..5`` and answer
``tokens``, ``token_logprobs``, ``top_logprobs`` (text -> log-probability) and
``text_offset`` (each token's start within the completion's text). The log-probabilities
are the model's own (raw logits), whatever the sampling settings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["chat_logprobs", "completion_logprobs", "requested"]

MAX_CHAT_TOP = 20  # OpenAI's bounds
MAX_COMPLETION_TOP = 5

TokenText = Callable[[int], bytes]
Refuse = Callable[[str, str], Exception]  # (field, why) -> the error to raise (wire.bad)


def requested(body: dict[str, Any], kind: str, bad: Refuse) -> int | None:
    """How many alternatives per token the request asks for; None when it asks for none."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "chat":
        if asked is not None and not isinstance(asked, bool):
            raise bad("logprobs", "must be true or false")
        if top is not None and (
            isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_CHAT_TOP
        ):
            raise bad("top_logprobs", f"must be an integer from 0 to {MAX_CHAT_TOP}")
        if top is not None and not asked:
            raise bad("top_logprobs", "needs logprobs: true")
        return (top or 0) if asked else None
    if top is not None:
        raise bad("top_logprobs", "is a chat field; completions take logprobs: 0..5")
    if asked is None:
        return None
    if (
        isinstance(asked, bool)
        or not isinstance(asked, int)
        or not 0 <= asked <= MAX_COMPLETION_TOP
    ):
        raise bad("logprobs", f"must be null or an integer from 0 to {MAX_COMPLETION_TOP}")
    return asked


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def _entry(token_id: int, logprob: float, token_bytes: TokenText) -> dict[str, Any]:
    piece = token_bytes(token_id)
    return {"token": _text(piece), "logprob": logprob, "bytes": list(piece)}


def chat_logprobs(items: Sequence[Any], token_bytes: TokenText) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat reply (or of one streamed delta)."""
    content = []
    for item in items:
        entry = _entry(item.token_id, item.logprob, token_bytes)
        entry["top_logprobs"] = [_entry(i, lp, token_bytes) for i, lp in item.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    items: Sequence[Any], token_bytes: TokenText, offset: int = 0
) -> dict[str, Any]:
    """``choices[i].logprobs`` of a text completion; ``offset``: characters of the completion
    already sent (a stream's later chunks)."""
    tokens, starts = [], []
    for item in items:
        starts.append(offset)
        text = _text(token_bytes(item.token_id))
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{_text(token_bytes(i)): lp for i, lp in item.top} for item in items],
        "text_offset": starts,
    }
