"""Chat prompts to token ids, with message content read as plain text.

A chat template's own markup (``<|im_start|>user``) becomes special tokens; the text of the
messages must not: a user who types ``<|im_start|>system`` would otherwise forge a system
turn. Content that spells a special token is found in the rendered prompt and tokenized with
special-token parsing off; everything else is tokenized as one text, so ordinary chats get
exactly the ids of a plain ``encode``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ChatTemplateError

if TYPE_CHECKING:
    from ..runtimes.base import Tokenizer

__all__ = ["encode_chat", "encode_plain"]

# Characters that open a special token's text; content is cut after them when an engine
# still matches a special token with special-token parsing off (llama.cpp always matches
# user-defined tokens).
_OPENERS = ("<", "[")


def _has_textless(tokenizer: Tokenizer, ids: Sequence[int]) -> bool:
    return any(tokenizer.token_bytes(t) == b"" for t in ids)


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of ``text`` read as characters only: no special or marker token comes out."""
    ids = tokenizer.encode(text, add_special=False, parse_special=False)
    if not _has_textless(tokenizer, ids):
        return ids
    pieces = [text]
    for opener in _OPENERS:
        pieces = [part for piece in pieces for part in _cut_after(piece, opener)]
    ids = [
        t
        for piece in pieces
        for t in tokenizer.encode(piece, add_special=False, parse_special=False)
    ]
    if _has_textless(tokenizer, ids):
        raise ChatTemplateError(
            "a message holds text that this model's tokenizer can only read as a special "
            "token; remove it, or pass parse_special_in_content=True if it is meant as markup"
        )
    return ids


def _cut_after(text: str, opener: str) -> list[str]:
    parts = text.split(opener)
    return [part + opener for part in parts[:-1]] + [parts[-1]] if len(parts) > 1 else [text]


def encode_chat(
    tokenizer: Tokenizer, text: str, messages: Sequence[Mapping[str, Any]], *, add_special: bool
) -> list[int]:
    """Ids of the rendered chat ``text``; the contents of ``messages`` that spell special
    tokens are located in ``text`` (in order) and read as plain text."""
    spans = _special_content_spans(tokenizer, text, messages)
    if not spans:
        return tokenizer.encode(text, add_special=add_special)
    ids: list[int] = []
    pos = 0
    for start, end in spans:
        ids += tokenizer.encode(text[pos:start], add_special=add_special and pos == 0)
        ids += encode_plain(tokenizer, text[start:end])
        pos = end
    if pos < len(text):
        ids += tokenizer.encode(text[pos:], add_special=False)
    return ids


def _special_content_spans(
    tokenizer: Tokenizer, text: str, messages: Sequence[Mapping[str, Any]]
) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    pos = 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str) or not content:
            continue
        if not _has_textless(tokenizer, tokenizer.encode(content, add_special=False)):
            continue
        start = text.find(content, pos)
        needle = content
        if start < 0:  # templates may trim content
            needle = content.strip()
            start = text.find(needle, pos) if needle else -1
        if start < 0:
            raise ChatTemplateError(
                f"messages[{i}] holds special-token text that the chat template changes, so "
                "it cannot be kept as plain text; remove it, or pass "
                "parse_special_in_content=True if it is meant as markup"
            )
        spans.append((start, start + len(needle)))
        pos = start + len(needle)
    return spans
