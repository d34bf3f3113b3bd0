"""The backend protocol every engine implements, and the tokenizer it hands to the generator.

A backend owns the engine session and the KV cache, sized once when it is opened. It does
arithmetic only: the generator (``edgeinfer.generation``) samples, detokenizes and stops.

Logits are float32 numpy arrays of shape [vocab] for the last position. They may be views of
an engine-owned buffer, valid until the next ``prefill``/``decode``/``rewind``/``close``;
callers that keep them must copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edgeinfer.errors import InvalidRequestError

__all__ = ["Backend", "Tokenizer", "TokenizerBase", "check_fits"]


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

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text (``<|im_start|>``) maps to its id.

        ``add_special`` adds the BOS/EOS tokens the model is configured to add.
        """

    def token_bytes(self, token_id: int) -> bytes:
        """UTF-8 bytes one token contributes to the text; ``b""`` for control tokens."""

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
