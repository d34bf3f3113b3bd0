"""Speculative decoding: drafts checked in one pass give the tokens plain decoding gives.

On a backend whose logits depend on the whole history (so a draft left in the cache after it
was rejected changes everything after it) and on the tiny GGUF through llama.cpp, every
request is run twice in the same test, plainly and with drafting, and the token ids compared.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer import InvalidRequestError
from edgeinfer.generation.speculative import (
    MAX_DRAFT,
    DraftBudget,
    PassCosts,
    PromptLookup,
    Speculation,
    SpeculativeConfig,
    parse_speculative,
)
from edgeinfer.model import Model

from . import ggufgen
from .fakes import EOS, VOCAB, FakeTokenizer


class CopyingBackend:
    """Logits that favour copying: the token that followed the last earlier occurrence of the
    current token gets a boost, on top of noise seeded by the last four tokens and the
    position, so the model copies stretches of its prompt and then strays."""

    def __init__(self, n_ctx: int = 512, boost: float = 4.0) -> None:
        self.tokenizer = FakeTokenizer()
        self.cache: list[int] = []
        self._n_ctx = n_ctx
        self._boost = boost
        self.passes = 0  # forward passes run (one per decode or forward call)
        self.closed = False

    n_ctx = property(lambda self: self._n_ctx)
    n_past = property(lambda self: len(self.cache))
    reuse_is_exact = True
    kv_nbytes = 0
    multi_position_logits = True

    @property
    def info(self) -> dict:
        return {"backend": "copying-fake"}

    def _logits(self) -> np.ndarray:
        h = self.cache
        seed = hashlib.sha256(repr((len(h), h[-4:])).encode()).digest()
        x = np.random.default_rng(int.from_bytes(seed[:8], "little")).normal(0, 1, VOCAB)
        x[EOS] -= 8
        last = h[-1]
        for j in range(len(h) - 2, -1, -1):
            if h[j] == last:
                x[h[j + 1]] += self._boost
                break
        return x.astype(np.float32)

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        self.cache.extend(token_ids)
        self.passes += 1
        return self._logits()

    def decode(self, token_id: int) -> np.ndarray:
        return self.prefill([token_id])

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        self.passes += 1
        rows = []
        for t in token_ids:
            self.cache.append(t)
            rows.append(self._logits())
        return np.stack(rows)

    def rewind(self, n: int) -> None:
        assert 0 <= n <= len(self.cache)
        del self.cache[n:]

    def close(self) -> None:
        self.closed = True


PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "Summarise: Paris is the capital of France. Paris is",
    "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
    '{"name": "Ada", "age": 36} -> {"name": "Ada", "age"',
    "abcabcabcabcabc",
    "no repeats here at all",
    "x",
]


@pytest.fixture
def copying() -> Model:
    return Model(CopyingBackend(), name="copying", path=Path("copying"), model_format="fake")


@pytest.mark.parametrize("spec", ["lookup", "lookup:1", "lookup:3", "auto"])
def test_greedy_tokens_equal_plain_decoding(copying: Model, spec: str) -> None:
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = copying.generate(prompt, max_new_tokens=48, temperature=0)
        fast = copying.generate(prompt, max_new_tokens=48, temperature=0, speculative=spec)
        assert fast.token_ids == plain.token_ids, prompt
        assert fast.text == plain.text and fast.finish_reason == plain.finish_reason
        assert 0 <= fast.stats.accepted_tokens <= fast.stats.draft_tokens
        assert plain.stats.draft_tokens == 0
        drafted += fast.stats.draft_tokens
        accepted += fast.stats.accepted_tokens
    assert accepted > 0 and drafted > accepted  # drafts were kept, and some were not


def test_sampled_tokens_equal_plain_under_a_seed(copying: Model) -> None:
    for seed in range(12):
        for prompt in PROMPTS[:4]:
            kw = {"max_new_tokens": 32, "temperature": 0.8, "top_k": 0, "top_p": 1.0}
            plain = copying.generate(prompt, seed=seed, **kw)
            fast = copying.generate(prompt, seed=seed, speculative="lookup", **kw)
            assert fast.token_ids == plain.token_ids, (seed, prompt)


def test_next_token_frequencies_follow_the_target_distribution(copying: Model) -> None:
    """Over many seeds, the second token of a drafted reply is distributed as plain
    sampling's (a chi-square-like bound on the total variation)."""
    prompt = PROMPTS[1]
    counts: dict[str, dict[int, int]] = {"off": {}, "lookup": {}}
    for spec in counts:
        for seed in range(300):
            r = copying.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=0, top_p=1.0,
                                 seed=10_000 + seed, speculative=spec)  # fmt: skip
            token = r.token_ids[1] if len(r.token_ids) > 1 else -1
            counts[spec][token] = counts[spec].get(token, 0) + 1
    keys = set(counts["off"]) | set(counts["lookup"])
    tv = sum(abs(counts["off"].get(k, 0) - counts["lookup"].get(k, 0)) for k in keys) / 600
    assert tv == 0.0  # the same draws: identical, not only close


def test_drafting_reads_fewer_passes_on_copying_text(copying: Model) -> None:
    backend = copying._backend
    prompt = PROMPTS[3] * 4
    backend.passes = 0
    plain = copying.generate(prompt, max_new_tokens=64, temperature=0)
    plain_passes, backend.passes = backend.passes, 0
    fast = copying.generate(prompt, max_new_tokens=64, temperature=0, speculative="lookup")
    assert fast.token_ids == plain.token_ids
    assert backend.passes < plain_passes
    assert backend.passes + fast.stats.accepted_tokens == plain_passes


def test_the_model_default_applies_and_a_request_overrides_it() -> None:
    model = Model(CopyingBackend(), name="c", path=Path("c"), model_format="fake",
                  speculative=parse_speculative("lookup"))  # fmt: skip
    on = model.generate(PROMPTS[0], max_new_tokens=48, temperature=0)
    off = model.generate(PROMPTS[0], max_new_tokens=48, temperature=0, speculative="off")
    assert on.stats.draft_tokens > 0 and off.stats.draft_tokens == 0
    assert on.token_ids == off.token_ids


def test_stream_and_chat_take_it_too(copying: Model) -> None:
    chunks = list(
        copying.stream(PROMPTS[1], max_new_tokens=24, temperature=0, speculative="lookup")
    )
    plain = copying.generate(PROMPTS[1], max_new_tokens=24, temperature=0)
    assert "".join(c.text for c in chunks) == plain.text
    assert chunks[-1].stats is not None and chunks[-1].stats.draft_tokens > 0
    messages = [{"role": "user", "content": PROMPTS[1]}]
    a = copying.chat(messages, max_new_tokens=16, temperature=0)
    b = copying.chat(messages, max_new_tokens=16, temperature=0, speculative="auto")
    assert a.token_ids == b.token_ids


def test_cancel_mid_verify_and_stop_strings_keep_the_cache_consistent(copying: Model) -> None:
    backend = copying._backend
    stream = copying.stream(PROMPTS[3], max_new_tokens=64, temperature=0, speculative="lookup")
    next(stream)
    stream.cancel()
    assert stream.collect().finish_reason == "cancelled"
    whole = copying.generate(PROMPTS[0], max_new_tokens=40, temperature=0).text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]  # a stop string met mid-reply
    plain = copying.generate(PROMPTS[0], max_new_tokens=40, temperature=0, stop=[stop])
    fast = copying.generate(PROMPTS[0], max_new_tokens=40, temperature=0, stop=[stop],
                            speculative="lookup")  # fmt: skip
    assert fast.text == plain.text and fast.finish_reason == plain.finish_reason == "stop"
    assert fast.stats.draft_tokens > 0
    assert backend.n_past == len(copying._history.tokens)  # no rejected draft left behind


# -- the parts ---------------------------------------------------------------------------


@given(st.one_of(st.text(max_size=40), st.integers(), st.none(), st.booleans(), st.floats()))
@settings(max_examples=300, deadline=None)
def test_parse_accepts_its_modes_and_refuses_the_rest_with_a_typed_error(value: object) -> None:
    try:
        parsed = parse_speculative(value)
    except InvalidRequestError as exc:
        assert "speculative=" in str(exc)
        return
    assert isinstance(parsed, SpeculativeConfig)
    assert 1 <= parsed.max_draft <= MAX_DRAFT


@pytest.mark.parametrize("value", ["lookup:0", f"lookup:{MAX_DRAFT + 1}", "lookup:-1", "LOOKUP",
                                   "lookup:٣", "draft", "auto ", ["auto"]])  # fmt: skip
def test_parse_refuses(value: object) -> None:
    with pytest.raises(InvalidRequestError):
        parse_speculative(value)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 8))
@settings(max_examples=300, deadline=None)
def test_a_lookup_draft_continues_an_earlier_occurrence_of_the_suffix(
    context: list[int], k: int
) -> None:
    lookup = PromptLookup(MAX_DRAFT)
    for n in range(1, len(context) + 1):  # called as a reply grows, one token at a time
        draft = lookup.propose(context[:n], k)
        assert len(draft) <= k
        if not draft:
            continue
        seen = context[:n]
        found = any(
            seen[end - size : end] == seen[n - size :] and seen[end : end + len(draft)] == draft
            for size in (3, 2, 1)
            for end in range(size, n)
            if n >= size
        )
        assert found


def _costs(per_draft: float, top: int = 8) -> PassCosts:
    """Measured costs: a 10 ms step, and a pass over 1 + k tokens at 1 + per_draft * k steps
    for k up to ``top``."""
    costs = PassCosts()
    costs.record_step(0.010)
    for k in range(1, top + 1):
        costs.record_pass(k, 0.010 * (1 + per_draft * k))
    return costs


def test_the_budget_stops_drafting_when_drafts_are_not_kept() -> None:
    costs = _costs(0.5)  # a pass costs half a step per draft
    budget = DraftBudget(parse_speculative("auto"), costs)
    assert budget.k() > 0
    for _ in range(20):
        budget.record(4, 0)
    assert [budget.k() for _ in range(31)] == [0] * 31
    assert budget.k() == 1  # a probe now and then
    for _ in range(20):
        budget.record(4, 4)
    assert budget.k() >= 4


# -- a real engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ggufgen.tiny_llama(seed=3).write(tmp_path_factory.mktemp("spec") / "tiny.gguf")


REAL_PROMPTS = [p * 2 for p in PROMPTS]


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.fixture(scope="module", params=["llama.cpp", "onnxruntime"])
def real_model(request: pytest.FixtureRequest, tiny_gguf: Path, tmp_path_factory) -> Path:
    """The tiny GGUF as it is (llama.cpp), or transcoded by the native builder (onnxruntime)."""
    if request.param == "llama.cpp":
        return tiny_gguf
    from edgeinfer.cli import main as cli_main

    out = tmp_path_factory.mktemp("spec-onnx") / "native"
    assert cli_main(["convert", str(tiny_gguf), "-o", str(out), "--threads", "1"]) == 0
    return out


def test_real_engines_give_plain_greedy_tokens_beyond_kernel_noise(real_model: Path) -> None:
    """A pass over several positions may use other kernels than one-token steps: where the
    tokens differ, plain decoding's top-two margin there must be tiny."""
    with edgeinfer.load(real_model, threads=1, context_length=256) as model:
        assert model._backend.multi_position_logits
        eos = {model.tokenize("<|endoftext|>", parse_special=True)[0]: float("-inf")}
        drafted = 0
        for prompt in REAL_PROMPTS:
            kw = {"max_new_tokens": 40, "temperature": 0, "logit_bias": eos}
            plain = model.generate(prompt, **kw)
            fast = model.generate(prompt, speculative="lookup", **kw)
            drafted += fast.stats.draft_tokens
            at = _first_divergence(plain.token_ids, fast.token_ids)
            if at is None:
                continue
            ids = model.tokenize(prompt) + list(plain.token_ids[:at])
            backend = model._backend
            backend.rewind(0)
            model._history.tokens.clear()
            model._history.batched = 0
            top2 = np.sort(np.asarray(backend.prefill(ids), dtype=np.float64))[-2:]
            assert top2[1] - top2[0] < 1e-3, (prompt, at)
        assert drafted > 0


def test_a_verify_pass_gives_what_steps_give(real_model: Path) -> None:
    """``forward`` over k tokens returns each position's logits, as k one-token steps do
    (within the kernels' noise), and leaves the same cache behind."""
    with edgeinfer.load(real_model, threads=1, context_length=256) as model:
        backend = model._backend
        prompt = model.tokenize(REAL_PROMPTS[0])
        tail = prompt[-6:]
        backend.rewind(0)
        backend.prefill(prompt[:-6])
        rows = np.array(backend.forward(tail))
        assert rows.shape == (6, model._tokenizer.n_vocab)
        after = np.array(backend.decode(tail[0]))
        backend.rewind(len(prompt) - 6)
        steps = [np.array(backend.decode(t)) for t in tail]
        assert backend.n_past == len(prompt)
        for row, step in zip(rows, steps, strict=True):
            assert np.argmax(row) == np.argmax(step)
            np.testing.assert_allclose(row, step, atol=2e-3)
        assert after.shape == rows[0].shape
        model._history.tokens.clear()
        model._history.batched = 0


def test_the_cli_flag_reaches_the_request(tiny_gguf: Path) -> None:
    base = [sys.executable, "-m", "edgeinfer", "run", str(tiny_gguf), "-p", PROMPTS[1] * 2,
            "-n", "16", "--temperature", "0", "--threads", "1", "--json"]  # fmt: skip
    plain = json.loads(subprocess.run(base, capture_output=True, text=True, check=True).stdout)
    fast = json.loads(
        subprocess.run(
            [*base, "--speculative", "lookup"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert fast["token_ids"] == plain["token_ids"]
    assert fast["stats"]["draft_tokens"] > 0 and plain["stats"]["draft_tokens"] == 0
    bad = subprocess.run([*base, "--speculative", "lookup:99"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("edgeinfer: error: speculative=")
    assert "Traceback" not in bad.stderr


def test_load_refuses_a_bad_setting_before_opening_anything(tiny_gguf: Path) -> None:
    with pytest.raises(InvalidRequestError, match="speculative="):
        edgeinfer.load(tiny_gguf, speculative="sometimes")


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"],
    "additionalProperties": False,
}


def test_grammar_fast_forward_drafts_the_forced_tokens(real_model: Path) -> None:
    """Under a JSON schema the keys and punctuation the grammar forces are drafted and kept;
    the reply is plain decoding's."""
    pytest.importorskip("llguidance")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    with edgeinfer.load(real_model, threads=1, context_length=256) as model:
        kw = {"max_new_tokens": 48, "temperature": 0, "response_format": fmt}
        plain = model.generate("Note: Ada lives in Paris.", **kw)
        fast = model.generate("Note: Ada lives in Paris.", speculative="auto", **kw)
        assert fast.token_ids == plain.token_ids
        assert fast.stats.accepted_tokens >= 8  # at least the two keys' forced spelling
        # off: no fast-forward either
        off = model.generate("Note: Ada lives in Paris.", speculative="off", **kw)
        assert off.stats.draft_tokens == 0


def test_the_budget_weighs_each_match_length_by_its_own_record() -> None:
    """Drafts after a one-token match that are never kept stop those drafts, not the drafts
    after a three-token match, which are kept."""
    budget = DraftBudget(SpeculativeConfig("lookup", 8, adaptive=True), _costs(0.1))
    for _ in range(20):
        budget.record(4, 0, kind=1)
        budget.record(4, 4, kind=3)
    assert budget.k(1) == 0
    assert budget.k(3) >= 4
    assert budget.kept_share == 0.6  # drafts of no kind: untouched


def test_auto_drafts_after_a_long_match_and_not_after_a_short_one() -> None:
    """The lookup's matched suffix length picks whose record decides the draft."""
    spec = Speculation(SpeculativeConfig("lookup", 8, adaptive=True), _costs(0.1, top=16))
    for _ in range(20):
        spec.budget.record(4, 0, kind=1)
    assert spec.propose([5, 6, 7, 8, 9, 1, 7], room=64) == []  # matches 7 alone
    assert spec.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], room=64)[:2] == [8, 9]  # matches 5 6 7


def test_the_kept_share_counts_only_the_drafts_a_pass_tested() -> None:
    """Eight drafts of which the first three are kept put four to the test (the fourth was
    refused, the last four never checked): the share learned is 3/4, not 3/8."""
    budget = DraftBudget(SpeculativeConfig("lookup", 8, adaptive=True), PassCosts())
    for _ in range(40):
        budget.record(8, 3, kind=3)
    assert budget.share(3) == pytest.approx(0.75, abs=1e-3)
    for _ in range(40):
        budget.record(8, 8, kind=2)  # every draft kept
    assert budget.share(2) == pytest.approx(1.0, abs=1e-3)
