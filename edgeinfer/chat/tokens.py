"""Chat prompts to token ids, with the caller's strings read as plain text.

A chat template's own markup (``<|im_start|>user``) becomes special tokens; the text of the
messages must not: a user who types ``<|im_start|>system`` would otherwise forge a system
turn. Where the template's text ends and a message's begins is known by construction (see
_slots: the template renders a second time with sentinels for the caller's strings); the
prompt is never searched for a message's text. A prompt whose special tokens are those of
that second render (the skeleton: template text and harmless stand-ins) is tokenized as one
text, so ordinary chats get exactly the ids of a plain ``encode``; otherwise the strings
that spell special tokens are tokenized with special-token parsing off, apart from the
template's text.

Equal sequences of special ids mean no string made one: a string that did would add an id,
or take the place of one of the template's, which changes the sequence, unless a special
token's text begins with its own end (as ``<|x|>`` does not) or the template writes fewer
markers when it sees that string. Where the template refused the stand-ins there is no
skeleton: each string is then checked alone, which misses a marker cut across two strings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ChatTemplateError
from ._slots import Piece, RenderedChat
from .template import render_chat, render_chat_pieces

if TYPE_CHECKING:
    from ..runtimes.base import Tokenizer

__all__ = ["encode_chat", "encode_messages", "encode_plain"]

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


def encode_messages(
    tokenizer: Tokenizer,
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    parse_special_in_content: bool = False,
) -> list[int]:
    """The prompt ids of ``messages`` through ``template``: the BOS token is added unless the
    template writes it, and the caller's strings are read as plain text (see encode_chat)
    unless ``parse_special_in_content``."""
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    if parse_special_in_content:
        text = render_chat(
            template,
            messages,
            bos_token=bos,
            eos_token=eos,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )
        return tokenizer.encode(text, add_special=not (bos and text.startswith(bos)))
    rendered = render_chat_pieces(
        template,
        messages,
        bos_token=bos,
        eos_token=eos,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
    )
    own = rendered.text if rendered.skeleton is None else rendered.skeleton
    add = not (bos and own.startswith(bos))  # the template's own text, not a message's
    return encode_chat(tokenizer, rendered, add_special=add)


def encode_chat(tokenizer: Tokenizer, rendered: RenderedChat, *, add_special: bool) -> list[int]:
    """Ids of ``rendered.text`` in which no string of the caller's becomes a special token:
    the special tokens are the template's own, in the template's places."""
    ids = tokenizer.encode(rendered.text, add_special=add_special)
    if rendered.skeleton == rendered.text:  # the template wrote none of the caller's text
        return ids
    reference = None
    if rendered.skeleton is not None:
        skeleton = tokenizer.encode(rendered.skeleton, add_special=add_special)
        reference = _textless(tokenizer, skeleton)
        if _textless(tokenizer, ids) == reference:
            return ids
    elif not any(_has_textless(tokenizer, _encode(tokenizer, v)) for v in rendered.values):
        return ids  # the template refused the stand-ins; no string spells a special token
    if rendered.pieces is None:
        raise ChatTemplateError(
            "a message holds text that reads as special tokens, and this chat template "
            "changes message text in a way that cannot be traced, so that text cannot be kept "
            "plain; remove it, or pass parse_special_in_content=True if it is meant as markup"
        )
    pieces = rendered.pieces
    spelled = [own and _has_textless(tokenizer, _encode(tokenizer, t)) for t, own in pieces]
    ids = _encode_pieces(tokenizer, pieces, spelled, add_special)
    if _textless(tokenizer, ids) == reference:
        return ids
    # a string makes a special token together with the text beside it: all apart
    return _encode_pieces(tokenizer, pieces, [own for _, own in pieces], add_special)


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special=False)


def _textless(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    return [t for t in ids if tokenizer.token_bytes(t) == b""]


def _encode_pieces(
    tokenizer: Tokenizer, pieces: Sequence[Piece], apart: Sequence[bool], add_special: bool
) -> list[int]:
    """Ids of the pieces' text: each piece marked ``apart`` read as plain text on its own,
    the text between them as one text with special tokens."""
    ids: list[int] = []
    run: list[str] = []
    first = True
    for (text, _), alone in zip(pieces, apart, strict=True):
        if not alone:
            run.append(text)
            continue
        if run or first:
            ids += tokenizer.encode("".join(run), add_special=add_special and first)
        run, first = [], False
        ids += encode_plain(tokenizer, text)
    if run or first:
        ids += tokenizer.encode("".join(run), add_special=add_special and first)
    return ids
