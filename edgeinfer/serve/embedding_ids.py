"""Token-id inputs of ``/v1/embeddings``: checked (``token_id_inputs``) and embedded as given
(``embed_token_ids``).

OpenAI's ``input`` may be one list of token ids or a list of such lists. The ids index the
served model's vocabulary (``0 .. vocab_size - 1``): OpenAI's tiktoken ids belong to
OpenAI's models and cannot be mapped onto another vocabulary, so an id outside the served
one is refused with the range, never wrapped or dropped. Bounds, like texts': at most
``MAX_IDS`` ids per input (OpenAI's own limit of one input), inputs within the request's
item limit and body size; an input past the model's maximum length is cut as a text's tokens
are (its last id kept) and reported ``truncated``.
"""

from __future__ import annotations

from typing import Any

from ..embedding.batches import EmbedResult
from ..model import Model
from . import wire

__all__ = ["MAX_IDS", "embed_token_ids", "token_id_inputs"]

MAX_IDS = 8192  # token ids in one input (OpenAI's limit for one input of its models)


def token_id_inputs(value: list[Any], vocab: int) -> list[list[int]]:
    """``value`` (a non-empty list whose first item is not a string) as lists of ids."""
    if all(_is_id(v) for v in value):
        return [_ids(value, "input", vocab)]
    lists = []
    for i, item in enumerate(value):
        if not isinstance(item, list):
            raise wire.bad(
                f"input[{i}]",
                f"input[{i}]={wire.shown(item)}: input must be a string, a list of strings, "
                "a list of token ids or a list of token-id lists (one kind throughout)",
            )
        lists.append(_ids(item, f"input[{i}]", vocab))
    return lists


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values: list[Any], where: str, vocab: int) -> list[int]:
    if not values:
        raise wire.bad(where, f"{where} is empty: give at least one token id")
    if len(values) > MAX_IDS:
        raise wire.bad(where, f"{where} has {len(values):,} token ids, more than {MAX_IDS:,}")
    for k, token in enumerate(values):
        if not _is_id(token):
            raise wire.bad(
                where, f"{where}[{k}]={wire.shown(token)} is not a token id (an integer)"
            )
        if not 0 <= token < vocab:
            raise wire.bad(
                where,
                f"{where}[{k}]={wire.shown(token)} is not a token id of the served model: its "
                f"ids run from 0 to {vocab - 1} (they index its own vocabulary, not OpenAI's "
                "tiktoken one; send text to be tokenized here)",
            )
    return list(values)


def embed_token_ids(model: Model, seqs: list[list[int]]) -> EmbedResult:
    """The vectors of checked id lists, through the model's own embedding path (batches,
    pooling, normalizing) with the ids in place of its tokenizer's."""
    return model.embed_ids(seqs)
