"""Speculative decoding on both real engines (llama.cpp and onnxruntime), sampled.

Every check runs the same request plainly and with drafting in the same test and compares;
nothing is compared with fixed words. A tiny random model never copies its prompt, so under
plain sampling hardly a draft is kept and the rows after a kept draft are seldom read. The
sampled tests therefore narrow the sampler's choice to five letters with ``logit_bias`` (+30
each: every other token together stays below 1e-7; the model's own logits still decide among
the five, and both paths apply the same bias), on a prompt that spells them over and over: the
model then repeats itself often enough that prompt lookup drafts at almost every step, a
share of the drafts is kept and the rest rejected, so verify rows after kept drafts and
steps after rewinds are both exercised.

Kernel noise: a verify pass over several positions may compute the logits in other kernels
than a one-token step (about 1e-5 apart on these models). With ``top_k=0`` and ``top_p=1``
the sampler draws one uniform number per token and compares it with the cumulative
probabilities, so a token can only change where that draw falls within ~1e-5 of a boundary:
tokens are compared exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeinfer
from edgeinfer.generation import scheduler, speculative
from edgeinfer.model import Model

from . import ggufgen
from .tool_templates import TINY_HERMES

CTX = 256
LETTERS = "aeiou"
LETTER_PROMPT = "aeiou uoiea aeiou eaiou " * 3
TEXT_PROMPT = "the cat sat on the mat. " * 3 + "the cat"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ggufgen.tiny_llama(seed=3).write(tmp_path_factory.mktemp("spec-real") / "tiny.gguf")


@pytest.fixture(scope="module", params=["llama.cpp", "onnxruntime"])
def model_path(
    request: pytest.FixtureRequest, tiny_gguf: Path, native_folder: Callable[[Path, int], Path]
) -> Path:
    """The tiny GGUF as it is (llama.cpp), or the native builder's ONNX folder of it."""
    if request.param == "llama.cpp":
        pytest.importorskip("llama_cpp")
        return tiny_gguf
    pytest.importorskip("onnxruntime")
    return native_folder(tiny_gguf, CTX)


@pytest.fixture
def model(model_path: Path) -> Iterator[Model]:
    with edgeinfer.load(model_path, threads=1, context_length=CTX) as loaded:
        assert loaded._backend.multi_position_logits  # verify passes run on this engine
        yield loaded


def letter_bias(model: Model) -> dict[int, float]:
    """+30 on the five letters, and the end-of-text token banned (every reply is full)."""
    bias = {model.tokenize(c)[0]: 30.0 for c in LETTERS}
    assert len(bias) == len(LETTERS)
    return {**bias, **no_end(model)}


def no_end(model: Model) -> dict[int, float]:
    return {model.tokenize("<|endoftext|>", parse_special=True)[0]: -math.inf}


def sampled(temperature: float, seed: int, bias: dict[int, float], n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": temperature, "top_k": 0, "top_p": 1.0,
            "seed": seed, "logit_bias": bias}  # fmt: skip


# -- 1. sampled tokens under a seed -------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_sampled_lookup_gives_plain_tokens_under_each_seed(
    model: Model, temperature: float
) -> None:
    """Six seeds, 32 tokens each, on the five-letter prompt and on a repeated sentence with
    no bias but the end token's: "lookup" gives plain sampling's token ids for each seed."""
    drafted = accepted = 0
    cases = [(LETTER_PROMPT, letter_bias(model)), (TEXT_PROMPT, no_end(model))]
    for prompt, bias in cases:
        for seed in range(6):
            kw = sampled(temperature, seed, bias, 32)
            plain = model.generate(prompt, **kw)
            fast = model.generate(prompt, speculative="lookup", **kw)
            assert len(plain.token_ids) == 32 and plain.stats.draft_tokens == 0
            assert fast.token_ids == plain.token_ids, (prompt, seed)
            assert fast.text == plain.text and fast.finish_reason == plain.finish_reason
            assert 0 <= fast.stats.accepted_tokens <= fast.stats.draft_tokens
            drafted += fast.stats.draft_tokens
            accepted += fast.stats.accepted_tokens
    # drafts were kept (so the rows after them were sampled) and drafts were rejected (so
    # their entries were rewound before the next step)
    assert drafted > accepted > 0


# -- 2. the distribution, position by position after verify passes ------------------------------


@dataclass
class Pass:
    """One verify pass: where its first row's token went in the reply, the tokens drafted,
    the sampler's probability of each draft at its row, and the tokens its rows gave."""

    start: int
    drafts: list[int]
    draft_probs: list[float]
    made: list[int]

    @property
    def kept(self) -> int:
        n = 0
        while n < min(len(self.drafts), len(self.made)) and self.made[n] == self.drafts[n]:
            n += 1
        return n


def _probs(logits: np.ndarray, bias: dict[int, float], temperature: float) -> np.ndarray:
    """The sampler's distribution for one row (bias, temperature; no top-k/top-p/min-p)."""
    x = np.array(logits, dtype=np.float64)
    for token, value in bias.items():
        x[token] += value
    x = (x - x.max()) / temperature
    p = np.exp(x)
    return p / p.sum()


def record_passes(
    monkeypatch: pytest.MonkeyPatch, bias: dict[int, float], temperature: float
) -> list[Pass]:
    """Every verify pass the engine runs from now on, as ``Pass`` records."""
    passes: list[Pass] = []
    current: dict[str, Any] = {}
    feed, verify = scheduler.feed, scheduler.Engine._verify

    def recorded_feed(backend: Any, token: int, drafts: list[int], spec: Any) -> Any:
        rows = feed(backend, token, drafts, spec)
        if drafts:
            probs = [_probs(rows[i], bias, temperature)[d] for i, d in enumerate(drafts)]
            current.update(drafts=list(drafts), probs=probs)
        return rows

    def recorded_verify(self: Any, slot: Any) -> None:
        seq = slot.seq
        start = len(seq.generated)  # the pending token is generated[start - 1]
        current.clear()
        verify(self, slot)
        if current:
            made = list(seq.generated[start:])
            passes.append(Pass(start, current["drafts"], current["probs"], made))

    monkeypatch.setattr(scheduler, "feed", recorded_feed)
    monkeypatch.setattr(scheduler.Engine, "_verify", recorded_verify)
    return passes


SEEDS = 300
LENGTH = 10


def test_tokens_after_verify_passes_are_distributed_as_plain_sampling(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over 300 seeds of 10 tokens, at every position of the reply (most of them read after
    an earlier verify pass: in a row after a kept draft, or in a step after a rewind), the
    tokens under "lookup" are plain sampling's for the same seed, so their frequencies at
    each position are identical (total variation 0). Identical tokens per seed is used
    rather than a bound on the frequencies: it is the stronger claim, it holds here (see the
    module docstring), and a bound loose enough never to fail by chance would let small
    biases through.

    A statistic that does not lean on the shared seed: each draft a pass put to the test
    must be kept with the target's probability of it at its row (Leviathan et al.'s rule for
    a one-token draft), given all that came before; so the count kept minus the sum of those
    probabilities has mean 0 and variance the sum of p(1 - p) (about 2,200 drafts tested,
    about 630 kept), and must stay within 4.5 standard deviations (a chance failure about
    once in 150,000; a sampler that kept every draft is off by about 160)."""
    temperature, bias = 1.0, letter_bias(model)
    plain = [
        model.generate(LETTER_PROMPT, **sampled(temperature, seed, bias, LENGTH)).token_ids
        for seed in range(SEEDS)
    ]
    passes = record_passes(monkeypatch, bias, temperature)
    fast, after_kept, after_rewind = [], 0, 0
    tested: list[tuple[bool, float]] = []  # (kept, the target's probability of the draft)
    for seed in range(SEEDS):
        del passes[:]
        kw = sampled(temperature, seed, bias, LENGTH)
        fast.append(model.generate(LETTER_PROMPT, speculative="lookup", **kw).token_ids)
        # positions whose token came from a row after a kept draft; and positions read after
        # a pass whose rejected drafts were rewound
        after_kept += sum(max(0, len(p.made) - 1) for p in passes)
        rewound = [p.start + len(p.made) for p in passes if p.kept < len(p.drafts)]
        after_rewind += max(0, LENGTH - min(rewound)) if rewound else 0
        for p in passes:
            for i in range(min(len(p.drafts), len(p.made))):
                tested.append((p.made[i] == p.drafts[i], p.draft_probs[i]))
    differ = [seed for seed in range(SEEDS) if fast[seed] != plain[seed]]
    tv = [
        _total_variation([t[pos] for t in plain], [t[pos] for t in fast]) for pos in range(LENGTH)
    ]
    assert not differ and max(tv) == 0.0, (differ[:10], tv)
    assert after_kept >= 100 and after_rewind >= 100, (after_kept, after_rewind)
    kept = sum(x for x, _ in tested)
    expected = sum(p for _, p in tested)
    spread = math.sqrt(sum(p * (1 - p) for _, p in tested))
    assert len(tested) >= 500 and 0 < kept < len(tested)
    assert abs(kept - expected) < 4.5 * spread, (kept, expected, spread, len(tested))


def _total_variation(a: Sequence[int], b: Sequence[int]) -> float:
    keys = set(a) | set(b)
    return sum(abs(a.count(k) - b.count(k)) for k in keys) / (2 * len(a))


# -- 3. grammar fast-forward: a choice, and a tool call -----------------------------------------


def record_forced(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(forced, checked, kept) for every verify pass from now on: the drafts the grammar
    forced (they come first), the drafts the pass read, and how many of them were kept."""
    seen: list[tuple[int, int, int]] = []
    record = speculative.Speculation.record

    def recorded(self: speculative.Speculation, checked: int, kept: int) -> None:
        seen.append((self._forced, checked, kept))
        record(self, checked, kept)

    monkeypatch.setattr(speculative.Speculation, "record", recorded)
    return seen


CHOICES = ["the cat sat on the mat", "one two three four five six", "aeiou and sometimes y"]
CHOICE = {"type": "choice", "choices": CHOICES}
PICK = "Pick: " + ", ".join(CHOICES)
ASK = [{"role": "user", "content": "Pick one."}]


def _ask(model: Model, how: str, spec: str, **kw: Any) -> Any:
    if how == "generate":
        return model.generate(PICK, speculative=spec, **kw)
    return model.chat(ASK, speculative=spec, **kw)


@pytest.mark.parametrize("spec", ["lookup", "auto"])
def test_a_choice_is_fast_forwarded_and_gives_plain_tokens(
    model: Model, spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its first token picks one of the strings, the grammar forces the rest: those
    tokens are drafted (under "auto" too, whatever the budget says) and kept, and the reply
    is plain decoding's, greedy and sampled, through generate and through chat. (A choice
    leaves nothing to reject mid-reply: the rewind is the tool-call test's, below.)"""
    pytest.importorskip("llguidance")
    model.use_chat_template(TINY_HERMES)
    passes = record_forced(monkeypatch)
    for seed in (None, 0, 1, 2):
        kw: dict[str, Any] = {"max_new_tokens": 48, "response_format": CHOICE, "seed": seed,
                              "temperature": 0 if seed is None else 1.0}  # fmt: skip
        for how in ("generate", "chat"):
            plain, fast = _ask(model, how, "off", **kw), _ask(model, how, spec, **kw)
            assert fast.token_ids == plain.token_ids, (how, seed)
            assert fast.text == plain.text and fast.text in CHOICES
            assert fast.finish_reason == plain.finish_reason == "stop"
            assert plain.stats.draft_tokens == 0
            assert fast.stats.accepted_tokens <= fast.stats.draft_tokens
    assert sum(min(forced, kept) for forced, _, kept in passes) > 0  # forced tokens kept


TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "enum": ["UTC", "CET"]},
                # one byte a token whatever is sampled (no escapes): the call always fits
                "note": {"type": "string", "pattern": "^[a-z ]{1,16}$"},
            },
            "required": ["zone", "note"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_a_forced_tool_call_is_fast_forwarded_and_gives_plain_tokens(
    model: Model, choice: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under tools with a call required (or a function named), the call's frame, keys and
    closing are forced by its grammar: drafted and kept. Inside the free ``note`` string
    prompt lookup guesses, and its rejected guesses are rewound before the forced tokens go
    on. The call is plain decoding's, token for token."""
    pytest.importorskip("llguidance")
    model.use_chat_template(TINY_HERMES)
    passes = record_forced(monkeypatch)
    for seed in range(3):
        kw = {"tools": [TOOL], "tool_choice": choice, "parallel_tool_calls": False,
              "max_new_tokens": 120, "seed": seed, "temperature": 1.0}  # fmt: skip
        plain = model.chat(ASK, **kw)
        fast = model.chat(ASK, speculative="lookup", **kw)
        assert fast.token_ids == plain.token_ids, seed
        assert fast.finish_reason == plain.finish_reason == "tool_calls", fast.tool_call_error
        assert [c["function"] for c in fast.tool_calls] == [c["function"] for c in plain.tool_calls]
    assert sum(min(forced, kept) for forced, _, kept in passes) > 0  # forced tokens kept
    assert any(kept < checked for _, checked, kept in passes)  # and guesses rewound mid-call


# -- 4. generate_many with a per-request setting ------------------------------------------------


@pytest.mark.parametrize("parallel", [1, 2])
def test_generate_many_speculates_per_request(
    model_path: Path, parallel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests of one batch that ask for "lookup" draft when they run alone (at parallel=2:
    the long one, once the others have ended), the one that does not ask never drafts, and
    every reply is plain decoding's (each request run alone, plainly, on the same model)."""
    with edgeinfer.load(model_path, threads=1, context_length=CTX, parallel=parallel) as model:
        bias = letter_bias(model)
        busy: list[int] = []  # sequences running at each verify pass
        feed = scheduler.feed

        def watched(backend: Any, token: int, drafts: list[int], spec: Any) -> Any:
            if drafts:
                busy.append(model.activity["busy"] + model.activity["queued"])
            return feed(backend, token, drafts, spec)

        monkeypatch.setattr(scheduler, "feed", watched)
        requests: list[dict[str, Any]] = [
            {"prompt": LETTER_PROMPT, **sampled(1.0, 1, bias, 6), "speculative": "lookup"},
            {"prompt": LETTER_PROMPT, **sampled(0.8, 2, bias, 48), "speculative": "lookup"},
            {"prompt": TEXT_PROMPT, **sampled(1.0, 3, bias, 12)},
        ]
        results = model.generate_many(requests)
        for request, result in zip(requests, results, strict=True):
            fields = {k: v for k, v in request.items() if k not in ("prompt", "speculative")}
            plain = model.generate(request["prompt"], **fields)
            assert result.token_ids == plain.token_ids and result.text == plain.text
        short, long, off = (r.stats for r in results)
        assert off.draft_tokens == 0
        assert long.draft_tokens > long.accepted_tokens > 0  # it ran alone at the end
        if parallel == 1:
            assert short.draft_tokens > 0  # every request runs alone
        assert busy and set(busy) == {1}  # a verify pass ran only while its sequence was alone
