"""The backend protocol every engine implements, and the tokenizer it hands to the generator.

A backend owns the engine session and the KV cache, sized once when it is opened. It does
arithmetic only: the generator (``edgeinfer.generation.results``) samples, detokenizes and stops.

Logits are float32 numpy arrays of shape [vocab] for the last position. They may be views of
an engine-owned buffer, valid until the next ``prefill``/``decode``/``rewind``/``close``;
callers that keep them must copy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edgeinfer.errors import InvalidRequestError

__all__ = [
    "TOKEN_TEXT_RULE",
    "Backend",
    "KVState",
    "SlotBackend",
    "Tokenizer",
    "TokenizerBase",
    "aligned_chunks",
    "check_fits",
    "check_slot",
    "is_marker",
    "tokenizer_text",
]

TOKEN_TEXT_RULE = """Which tokens are text (the same rule for every vocabulary):
- normal tokens: their text; byte tokens (<0xHH>, byte-level BPE): their byte;
- control, unknown and unused tokens (GGUF token types 3, 2, 5), and tokenizer.json added
  tokens marked special: nothing;
- user-defined tokens (GGUF type 4) and non-special added tokens: their text (whitespace runs,
  HTML tags), unless the text is a marker: a name in angle or square brackets that is not an
  HTML element (<start_of_image>, <unused12>, <|tool_call|>), or an upper-case name in square
  brackets ([INST], [IMG]) -- nothing."""

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def tokenizer_text(text: str) -> str:
    """The text every backend's tokenizer reads of ``text`` (one rule for all): lone
    surrogates (``"\\ud800"``: a Python string can hold them, UTF-8 and tokenizers cannot)
    become U+FFFD, the replacement character, as invalid UTF-8 does when text is decoded."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def cut_keeping_last(seqs: Sequence[Sequence[int]], cut: int) -> list[list[int]]:
    """Each token-id list cut to ``cut`` ids, its last id kept (an encoder's closing [SEP]:
    the pooled vector of a cut text must still end as the model was trained to see)."""
    return [list(ids) if len(ids) <= cut else [*ids[: cut - 1], ids[-1]] for ids in seqs]


# HTML element names: user-defined tokens such as <table> or </td> are text models write.
_HTML_ELEMENTS = frozenset(
    "a abbr address area article aside audio b base bdi bdo blockquote body br button canvas "
    "caption cite code col colgroup data datalist dd del details dfn dialog div dl dt em embed "
    "fieldset figcaption figure footer form h1 h2 h3 h4 h5 h6 head header hr html i iframe img "
    "input ins kbd label legend li link main map mark meta meter nav noscript object ol "
    "optgroup option output p param picture pre progress q rp rt ruby s samp script section "
    "select small source span strong style sub summary sup table tbody td template textarea "
    "tfoot th thead time title tr track u ul var video wbr".split()
)
_MARKER = re.compile(r"^(?:<\|?/?([^<>\s]+?)\|?/?>|\[/?[A-Z][A-Z0-9_]*\])$")


def is_marker(text: str) -> bool:
    """True for a token text that marks structure rather than spelling words: a name in angle
    brackets that is not an HTML element (``<start_of_image>``, ``<|im_start|>``; but
    ``<table>``, ``</td>``, ``<br/>`` are text), or an upper-case name in square brackets
    (``[INST]``; but ``[i]`` is text)."""
    match = _MARKER.match(text)
    if match is None:
        return False
    if match.group(1) is not None and "|" not in text:
        return match.group(1).lower() not in _HTML_ELEMENTS
    return True


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one model."""

    @property
    def n_vocab(self) -> int: ...

    @property
    def bos_token(self) -> str | None:
        """Text of the begin-of-sequence token (for chat templates), or None."""

    @property
    def eos_token(self) -> str | None:
        """Text of the end-of-sequence token (for chat templates), or None."""

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template, or None if it has none."""

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``.

        ``add_special`` adds the BOS/EOS tokens the model is configured to add;
        ``parse_special`` maps special-token text (``<|im_start|>``) to its id, else such text
        is read as plain characters.
        """

    def token_bytes(self, token_id: int) -> bytes:
        """UTF-8 bytes one token contributes to the text; ``b""`` for tokens that are not
        text (see ``TOKEN_TEXT_RULE``)."""

    def is_end_of_generation(self, token_id: int) -> bool:
        """True for tokens that end a reply (EOS, end-of-turn)."""


@runtime_checkable
class Backend(Protocol):
    """An engine session with its KV cache."""

    tokenizer: Tokenizer

    @property
    def n_ctx(self) -> int:
        """Tokens the KV cache holds (the context length it was sized for)."""

    @property
    def n_past(self) -> int:
        """Tokens currently in the KV cache."""

    @property
    def reuse_is_exact(self) -> bool:
        """Whether a prompt read in two parts (after ``rewind``) gives exactly what it gives read
        whole; if not, the generator never reuses the cache."""

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the KV cache at its full size."""

    @property
    def info(self) -> dict[str, Any]:
        """Facts for ``Model.info``: backend, provider, device, threads, ..."""

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` (at least one) to the cache; logits of the last position."""

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token to the cache; logits of its position."""

    def rewind(self, n: int) -> None:
        """Drop cache entries at positions >= n (keep the first n tokens)."""

    def close(self) -> None:
        """Release the engine session; calling it again does nothing."""


@runtime_checkable
class KVState(Protocol):
    """A backend's KV cache, one sequence (slot) at a time, as bytes and back, in a layout
    the backend owns (``SlotBackend.kv_state()``; snapshots and the prompt cache use nothing
    else of it).

    ``layout()`` is every setting a sequence's KV numbers depend on (element type, context,
    batch, ...): a snapshot restores only where it is equal. ``bytes_per_token`` is one
    token's K and V in every layer, from the cache's element type. ``save(slot)`` returns
    buffers whose concatenation is the payload; ``load`` empties the slot, then fills it with
    ``n_tokens`` tokens from ``nbytes`` bytes that ``read`` writes into the buffers it is
    given (leaving the slot empty on any failure)."""

    @property
    def bytes_per_token(self) -> int: ...

    @property
    def copies_on_restore(self) -> bool:
        """Whether a restore holds a second copy of the payload in memory while it reads."""

    @property
    def whole_only(self) -> bool:
        """Whether a restored sequence can only be reused whole (never rewound into)."""

    def layout(self) -> dict[str, Any]: ...

    def payload_band(self, n_tokens: int) -> tuple[int, int]:
        """The least and most payload bytes a sequence of ``n_tokens`` tokens takes."""

    def save(self, slot: int) -> list[Any]: ...

    def load(
        self, slot: int, n_tokens: int, nbytes: int, read: Callable[[memoryview], None]
    ) -> None: ...


@runtime_checkable
class SlotBackend(Backend, Protocol):
    """A backend whose one model and one KV allocation hold ``n_slots`` sequences.

    Slot ``s`` (``0 <= s < n_slots``) is a sequence with its own cache of up to ``n_ctx``
    tokens. ``prefill``/``decode``/``rewind`` take the slot (default 0, so a slot backend
    is also a plain ``Backend`` driving slot 0) and ``n_past`` is slot 0's. ``decode_many``
    is the batched step: one forward pass appends one token to each listed slot and returns
    their logits, row ``i`` for ``steps[i]``, as a float32 array [len(steps), vocab] valid
    until the next call. ``kv_nbytes`` counts every slot.
    """

    @property
    def n_slots(self) -> int:
        """Sequences the KV allocation holds."""

    def slot_past(self, slot: int) -> int:
        """Tokens currently in slot ``slot``'s cache."""

    def prefill(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray: ...

    def decode(self, token_id: int, slot: int = 0) -> np.ndarray: ...

    def rewind(self, n: int, slot: int = 0) -> None: ...

    def decode_many(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        """Append token ``t`` to slot ``s`` for each ``(s, t)`` in ``steps`` (distinct slots),
        in one forward pass; the logits [len(steps), vocab] of those positions."""

    @property
    def multi_position_logits(self) -> bool:
        """Whether ``forward`` can return the logits of every position it reads."""

    def forward(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        """Append ``token_ids`` to slot ``slot`` in one pass; the logits of every position
        read, [len(token_ids), vocab] (speculative decoding's verify step, teacher-forced
        scoring)."""

    def kv_state(self) -> KVState:
        """The slots' KV cache as bytes and back (snapshots, the prompt cache)."""


def check_slot(slot: int, n_slots: int) -> int:
    """``slot`` if it names one of ``n_slots`` slots; InvalidRequestError otherwise."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < n_slots:
        raise InvalidRequestError(f"slot {slot!r} is not one of this model's {n_slots} slots")
    return slot


class TokenizerBase:
    """The facts every Tokenizer exposes, and a per-token cache in front of ``_piece``."""

    def __init__(
        self,
        *,
        n_vocab: int,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
    ) -> None:
        self._n_vocab = n_vocab
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._chat_template = chat_template if isinstance(chat_template, str) else None
        self._pieces: dict[int, bytes] = {}

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            if not 0 <= token_id < self._n_vocab:
                raise InvalidRequestError(f"token id {token_id} is outside the vocabulary")
            piece = self._piece(token_id)
            self._pieces[token_id] = piece
        return piece

    def _piece(self, token_id: int) -> bytes:
        raise NotImplementedError


def aligned_chunks(ids: list[int], n_past: int, size: int) -> list[list[int]]:
    """``ids`` (to be appended after ``n_past`` tokens) cut at absolute positions that are
    multiples of ``size``: a prompt read in two parts is batched as when read whole."""
    chunks = []
    start = 0
    while start < len(ids):
        room = size - (n_past + start) % size
        chunks.append(ids[start : start + room])
        start += room
    return chunks


def check_fits(token_ids: Sequence[int], n_past: int, n_ctx: int) -> list[int]:
    """``token_ids`` as ints, if at least one is given and all fit after ``n_past`` tokens."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise InvalidRequestError("prefill needs at least one token")
    if n_past + len(ids) > n_ctx:
        raise InvalidRequestError(
            f"{n_past + len(ids)} tokens do not fit the context of {n_ctx}; the context is full"
        )
    return ids
