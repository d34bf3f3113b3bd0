"""The workload every engine runs: the same prompt token ids, greedy, a fixed number of new
tokens with the end-of-generation tokens banned, so all engines do the same work."""

from __future__ import annotations

from typing import Any

# Plain English with ordinary words, numbers and punctuation, repeated as needed: it
# tokenizes like real prompts do, in any vocabulary.
PROMPT_TEXT = (
    "The harbour town woke slowly. Fishing boats came back before seven, and the market "
    "opened at half past eight with bread, apples, cheese and fresh fish on long wooden "
    "tables. A teacher walked her class of twenty-three children to the lighthouse, where "
    "the keeper explained how the lamp turned once every twelve seconds and could be seen "
    "thirty kilometres out at sea. In the afternoon the wind rose from the west, the ferry "
    "to the island was cancelled, and people stayed inside to read, cook and write letters. "
)


VARIANT_SHIFT = 11  # tokens of the text skipped per variant: each stream's prompt differs


def prompt_ids(model: Any, n: int, variant: int = 0) -> list[int]:
    """``n`` prompt token ids for ``model`` (an ``edgeinfer.Model``): BOS if the model adds
    one, then the tokens of ``PROMPT_TEXT`` repeated. ``variant`` k > 0 starts the text
    ``k * VARIANT_SHIFT`` tokens later: the same kind of prompt, of the same length, with
    other tokens (one per stream of a parallel run)."""
    head = model.tokenize("", add_special=True, parse_special=False)
    body = model.tokenize(PROMPT_TEXT, add_special=False, parse_special=False)
    ids = list(head)
    skip = (variant * VARIANT_SHIFT) % len(body) if body else 0
    while len(ids) < n + skip:
        ids.extend(body)
    return (ids[: len(head)] + ids[len(head) + skip :])[:n] if skip else ids[:n]


def end_of_generation_ids(model: Any) -> list[int]:
    """Every token id that would end generation (EOS, EOT, ...), to ban in the workload."""
    return [t for t in range(model.info["vocab_size"]) if model.is_end_token(t)]
