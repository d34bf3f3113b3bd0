"""The markup of a call format as a model's tokenizer holds it, and the markup that ends a
reply.

**Call markers as tokens.** Qwen 2.5's vocabulary holds ``<tool_call>`` and ``</tool_call>``
as single user-defined tokens, which the tokenizers render as nothing (runtimes.base's
``TOKEN_TEXT_RULE``: a marker is not text). A reply's text then holds a call's JSON without
its tags, and no call is found in it. So the tool layer reads the reply from its token ids,
writing each marker token out as its text (``ReplyText``), and a grammar names the marker by
its token id (``<[151657]>``), so a constrained call is written with the token the model was
trained on. A marker is taken as a token only where the tokenizer reads its text as exactly
one token that renders as nothing; elsewhere (byte vocabularies, the generic format on
models that know no tools) it is plain text and needs none of this.

**Tool-result markers end a reply.** The template wraps a tool's result in
``<tool_response>``...``</tool_response>`` inside a user turn (Hermes/Qwen, and edgeinfer's
generic format). Those tags are the environment's, never the assistant's: a model that
writes one has started to imagine a tool result (small models echo the last one, wrapper
and all). The reply ends before the first of them, as it would at a stop string: the text
before it is the answer, nothing after it is handed out. Stopping rather than stripping the
tags: what follows the tag is the model's imagination of a result, not an answer to show.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..generation.detokenizer import IncrementalDetokenizer
from ..generation.results import Chunk
from .formats import CallFormat

__all__ = ["Markers", "ReplyText", "find_markers"]

# the markup of each family whose text a tokenizer may hold as one textless token
_CALL_MARKUP = {
    "hermes": ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    "generic": ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    "llama3": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
}
# the texts that end a reply (the generic format writes <tool_response name="...">)
RESULT_MARKERS = ("<tool_response", "</tool_response>")


@dataclass(frozen=True)
class Markers:
    """``tokens``: marker token id -> its text; ``cut``: the texts a reply ends before."""

    tokens: Mapping[int, str] = field(default_factory=dict)
    cut: tuple[str, ...] = ()

    def token(self, text: str) -> int | None:
        """The id of the one token ``text`` is, if it is a marker token."""
        return next((i for i, t in self.tokens.items() if t == text), None)


def result_markers(fmt: CallFormat, template: str | None) -> tuple[str, ...]:
    """The tool-result markers of ``fmt``: the generic format's own, and a Hermes template's
    where its text writes them."""
    if fmt.name == "generic" or (fmt.name == "hermes" and "tool_response" in (template or "")):
        return RESULT_MARKERS
    return ()


def find_markers(tokenizer: Any, fmt: CallFormat, template: str | None) -> Markers:
    """The markers of ``fmt`` that ``tokenizer`` holds as one token rendering as nothing, and
    the result markers that end a reply."""
    tokens: dict[int, str] = {}
    for text in _CALL_MARKUP.get(fmt.name, ()):
        ids = tokenizer.encode(text, add_special=False, parse_special=True)
        if len(ids) == 1 and tokenizer.token_bytes(ids[0]) == b"":
            tokens[int(ids[0])] = text
    return Markers(tokens, result_markers(fmt, template))


class ReplyText:
    """The reply's text as the tool layer reads it: the stream's own text, or, when marker
    tokens are in play, the text of its token ids with each marker written out. The stop
    strings that generation applied (``stop``) are applied again here, so the two texts
    differ only by the markers."""

    def __init__(
        self,
        token_bytes: Callable[[int], bytes] | None = None,
        markers: Markers | None = None,
        stop: Sequence[str] = (),
    ) -> None:
        self._tokens = dict(markers.tokens) if markers is not None else {}
        self._detok: IncrementalDetokenizer | None = None
        if token_bytes is not None and self._tokens:
            marked = {i: t.encode("utf-8") for i, t in self._tokens.items()}
            self._detok = IncrementalDetokenizer(lambda i: marked.get(i) or token_bytes(i), stop)

    def take(self, chunk: Chunk) -> str:
        """The text ``chunk`` adds (with the rest of it when it is the last)."""
        if self._detok is None:
            return chunk.text
        text = "".join(self._detok.push(i) for i in chunk.token_ids)
        if chunk.finish_reason is not None:
            text += self._detok.finish()
        return text
