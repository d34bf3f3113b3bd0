"""Speculative decoding under a grammar: the forced tokens and prompt lookup in one pass.

A schema spells its keys and punctuation (the grammar forces them); the value after a key is
often copied from the prompt. So a pass reads the forced tokens and, after them, what prompt
lookup finds for the text they end with; a guess the grammar refuses is cut before the pass
(the sampler could never pick it); and the draft budget learns only from the guesses.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.generation import speculative as spec_module
from edgeinfer.generation.speculative import PassCosts, Speculation, SpeculativeConfig
from edgeinfer.generation.structured import compile_constraint

from .test_speculative import real_model, tiny_gguf  # noqa: F401 (fixtures: both engines)

LOOKUP4 = SpeculativeConfig("lookup", 4, adaptive=False)


class Grammar:
    """A constraint that forces ``forced`` next and takes only ``allowed`` tokens."""

    def __init__(self, forced: list[int], allowed: set[int]) -> None:
        self._forced = forced
        self._allowed = allowed

    def forced(self, limit: int) -> list[int]:
        return self._forced[:limit]

    def valid_prefix(self, tokens: list[int]) -> int:
        for i, token in enumerate(tokens):
            if token not in self._allowed:
                return i
        return len(tokens)


# the prompt spells 1 2 3 then 4 5 6 7; the reply so far ends with 9 1, and the grammar
# forces 2 3 next: lookup matches 1 2 3 across the forced tokens and guesses 4 5 6 7
CONTEXT = [8, 1, 2, 3, 4, 5, 6, 7, 9, 1]


def test_lookup_goes_on_after_the_forced_tokens_in_the_same_pass() -> None:
    spec = Speculation(LOOKUP4, PassCosts())
    drafts = spec.propose(CONTEXT, room=64, constraint=Grammar([2, 3], set(range(20))))
    assert drafts == [2, 3, 4, 5, 6, 7]


def test_a_guess_the_grammar_refuses_is_cut_before_the_pass() -> None:
    spec = Speculation(LOOKUP4, PassCosts())
    refuses_6 = set(range(20)) - {6}
    assert spec.propose(CONTEXT, room=64, constraint=Grammar([2, 3], refuses_6)) == [2, 3, 4, 5]
    # the forced tokens stay whatever the check says of them
    assert spec.propose(CONTEXT, room=64, constraint=Grammar([2, 3], set())) == [2, 3]
    # without forced tokens a refused first guess leaves a plain step
    assert spec.propose([*CONTEXT[:-1], 3], room=64, constraint=Grammar([], {0})) == []


def test_room_bounds_the_forced_tokens_and_the_guesses_together() -> None:
    spec = Speculation(LOOKUP4, PassCosts())
    assert spec.propose(CONTEXT, room=3, constraint=Grammar([2, 3], set(range(20)))) == [2, 3, 4]
    assert spec.propose(CONTEXT, room=2, constraint=Grammar([2, 3], set(range(20)))) == [2, 3]


def test_the_budget_learns_from_the_guesses_only() -> None:
    spec = Speculation(SpeculativeConfig("lookup", 4, adaptive=True), PassCosts())
    drafts = spec.propose(CONTEXT, room=64, constraint=Grammar([2, 3], set(range(20))))
    assert drafts[:2] == [2, 3] and len(drafts) > 2
    spec.record(len(drafts), 2)  # the forced two kept, every guess refused
    assert (spec.budget.drafted, spec.budget.accepted) == (len(drafts) - 2, 0)
    assert spec.budget.share(3) < 0.6  # lowered from its first value: these guesses fail
    spec.propose(CONTEXT, room=64, constraint=Grammar([2, 3], set()))  # forced tokens alone
    spec.record(2, 2)
    assert (spec.budget.drafted, spec.budget.accepted) == (len(drafts) - 2, 0)


def test_a_real_grammar_counts_the_tokens_it_takes_without_moving(tiny_gguf: Path) -> None:  # noqa: F811
    pytest.importorskip("llguidance")
    with edgeinfer.load(tiny_gguf, threads=1, context_length=128) as model:
        tokenizer = model._backend.tokenizer
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        constraint = compile_constraint(fmt, tokenizer)
        good = tokenizer.encode('{"name": "Ada", "city": "Paris"}', add_special=False)
        bad = tokenizer.encode('{"age": 3}', add_special=False)
        assert constraint.valid_prefix(good) == len(good)
        taken = constraint.valid_prefix(bad)
        assert taken < len(bad)
        assert constraint.valid_prefix(good) == len(good)  # the state did not move
        assert constraint.valid_prefix([]) == 0
        assert constraint.valid_prefix([-1, 10**9]) == 0  # out of the vocabulary: nothing


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"],
    "additionalProperties": False,
}


def test_passes_carry_forced_tokens_and_guesses_and_replies_stay_plain(
    real_model: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On both engines under a schema whose keys the prompt already spells: some pass reads
    the forced key and guesses after it, and the tokens are plain decoding's."""
    pytest.importorskip("llguidance")
    passes: list[tuple[int, int]] = []  # (forced, drafted) per proposal
    propose = Speculation.propose

    def counted(self: Speculation, context: Sequence[int], room: int, *args, **kw) -> list[int]:
        drafts = propose(self, context, room, *args, **kw)
        passes.append((self._forced, len(drafts)))
        return drafts

    monkeypatch.setattr(spec_module.Speculation, "propose", counted)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    prompt = 'Copy this: {"name": "Ada", "city": "Paris"}. Again: '
    with edgeinfer.load(real_model, threads=1, context_length=256) as model:
        kw = {"max_new_tokens": 40, "temperature": 0, "response_format": fmt}
        plain = model.generate(prompt, **kw)
        fast = model.generate(prompt, speculative="lookup", **kw)
    assert fast.token_ids == plain.token_ids
    assert any(drafted > forced > 0 for forced, drafted in passes), passes
