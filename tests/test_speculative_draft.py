"""A draft model for speculative decoding (``speculative="draft:NAME"``): the tokens are plain
decoding's, a draft that is its own target has every draft kept, a draft of another
vocabulary is refused, and the draft sits inside the memory plan.

Fakes first (a target and draft whose logits depend on the whole history, so a draft cache
out of step with the target's shows as drafts not kept), then two tiny GGUFs of one
vocabulary (a 2-layer target, a 1-layer draft) on llama.cpp and, converted, on onnxruntime,
then the real Qwen2.5-Coder pair (``-m model``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer import InvalidRequestError, MemoryBudgetError
from edgeinfer.files.source import resolve
from edgeinfer.generation.draft_model import DraftModel
from edgeinfer.generation.speculative import (
    MAX_DRAFT,
    DraftBudget,
    DraftCosts,
    PassCosts,
    SpeculativeConfig,
    parse_speculative,
)
from edgeinfer.memory.plan import plan_memory
from edgeinfer.memory.shape import shape_of
from edgeinfer.model import Model

from . import ggufgen
from .fakes import EOS
from .test_speculative import PROMPTS, CopyingBackend

# -- fakes ---------------------------------------------------------------------------------


def _drafted(draft: CopyingBackend, spec: str = "draft:fake:4", **target: Any) -> Model:
    """A CopyingBackend target whose draft model is ``draft``."""
    drafter = DraftModel(draft, name="fake", names=("/models/fake.gguf",), memory=123)
    config = dataclasses.replace(parse_speculative(spec), drafter=drafter)
    overflow = target.pop("overflow", "stop")
    return Model(CopyingBackend(**target), name="t", path=Path("t"), model_format="fake",
                 speculative=config, context_overflow=overflow)  # fmt: skip


def _in_step(model: Model) -> bool:
    """The draft's cache holds exactly the tokens it believes it holds."""
    drafter = model._spec.drafter
    assert drafter is not None
    return drafter.backend.cache == drafter._tokens


@pytest.mark.parametrize("k", [1, 3, MAX_DRAFT])
def test_a_draft_that_is_its_target_has_every_draft_kept(k: int) -> None:
    model = _drafted(CopyingBackend(), f"draft:fake:{k}")
    for prompt in PROMPTS:
        plain = model.generate(prompt, max_new_tokens=40, temperature=0, speculative="off")
        fast = model.generate(prompt, max_new_tokens=40, temperature=0)
        assert fast.token_ids == plain.token_ids, prompt
        assert fast.stats.draft_tokens > 0
        assert fast.stats.accepted_tokens == fast.stats.draft_tokens, prompt  # none rejected
        assert _in_step(model)


def test_a_weaker_draft_gives_plain_tokens_with_some_drafts_rejected() -> None:
    model = _drafted(CopyingBackend(boost=1.0), "draft:fake:4")
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = model.generate(prompt, max_new_tokens=40, temperature=0, speculative="off")
        fast = model.generate(prompt, max_new_tokens=40, temperature=0)
        assert fast.token_ids == plain.token_ids, prompt
        drafted, accepted = drafted + fast.stats.draft_tokens, accepted + fast.stats.accepted_tokens
        assert _in_step(model)
    assert 0 < accepted < drafted


def test_sampled_tokens_equal_plain_under_a_seed() -> None:
    model = _drafted(CopyingBackend(boost=2.0), "draft:fake:3")
    kw = {"max_new_tokens": 32, "temperature": 0.9, "top_k": 0, "top_p": 1.0}
    for seed in range(6):
        for prompt in PROMPTS[:4]:
            plain = model.generate(prompt, seed=seed, speculative="off", **kw)
            fast = model.generate(prompt, seed=seed, **kw)
            assert fast.token_ids == plain.token_ids, (seed, prompt)


def test_a_sliding_context_keeps_the_draft_in_step_with_the_window() -> None:
    model = _drafted(CopyingBackend(n_ctx=64), "draft:fake:4", n_ctx=64, overflow="slide")
    eos = {EOS: float("-inf")}
    plain = model.generate(PROMPTS[0], max_new_tokens=150, temperature=0, logit_bias=eos,
                           speculative="off")  # fmt: skip
    fast = model.generate(PROMPTS[0], max_new_tokens=150, temperature=0, logit_bias=eos)
    assert len(plain.token_ids) == 150 and fast.token_ids == plain.token_ids
    # drafting goes on after each slide (4 of every 5 tokens drafted and kept, but for the
    # slides' own steps): the draft follows the window, not the whole reply
    assert fast.stats.accepted_tokens == fast.stats.draft_tokens >= 100
    assert model._spec.drafter.n_past <= 64


def test_a_request_names_its_models_draft_or_another_setting() -> None:
    model = _drafted(CopyingBackend(), "draft:fake")
    plain = model.generate(PROMPTS[0], max_new_tokens=24, temperature=0, speculative="off")
    assert plain.stats.draft_tokens == 0
    for setting in ("lookup", "auto", "lookup:2", "draft:fake:2", "draft:/models/fake.gguf:3"):
        result = model.generate(PROMPTS[0], max_new_tokens=24, temperature=0, speculative=setting)
        assert result.token_ids == plain.token_ids, setting
    with pytest.raises(InvalidRequestError, match="loaded with the draft model 'fake'"):
        model.stream(PROMPTS[0], speculative="draft:other")  # refused before iterating
    passes = model._backend.passes
    with pytest.raises(InvalidRequestError, match=r"^requests\[1\]: speculative="):
        model.generate_many([PROMPTS[0], {"prompt": PROMPTS[1], "speculative": "draft:other"}])
    assert model._backend.passes == passes  # refused before any request ran
    bare = Model(CopyingBackend(), name="b", path=Path("b"), model_format="fake")
    with pytest.raises(InvalidRequestError, match="loaded without a draft model"):
        bare.generate(PROMPTS[0], speculative="draft:fake")


def test_info_names_the_draft_and_close_frees_it() -> None:
    draft = CopyingBackend()
    model = _drafted(draft, "draft:fake:5")
    info = model.info["speculative"]
    assert info == {"method": "draft", "max_draft": 5, "adaptive": False, "draft": "fake",
                    "draft_memory": 123}  # fmt: skip
    model.close()
    assert draft.closed and model._backend.closed
    model.close()  # again: nothing


def test_the_budget_weighs_the_drafts_own_steps() -> None:
    auto = parse_speculative("draft:fake")
    costs, drafting = PassCosts(), DraftCosts(prior_share=0.1)
    budget = DraftBudget(auto, costs, drafting)
    assert budget.k() == 0  # no plain step measured yet: one first
    costs.record_step(0.010)
    for k in range(1, 9):
        costs.record_pass(k, 0.010 * (1 + 0.1 * k))
    drafting.record(4, 0.004)  # a draft step: a tenth of the model's
    for _ in range(10):
        budget.record(4, 4)
    assert budget.k() >= 4
    drafting.record(1, 1.0)  # the draft turned as slow as 20 model steps: never worth it
    for _ in range(20):
        drafting.record(1, 0.2)
    assert budget.k() == 0
    fixed = DraftBudget(parse_speculative("draft:fake:3"), PassCosts(), drafting)
    assert fixed.k() == 3  # draft:NAME:N drafts N, whatever it costs


def test_a_draft_reads_a_long_prompt_only_where_the_reply_pays_it_back() -> None:
    """The draft must read the prompt before its first proposal; that read is weighed
    against what drafting saves over the tokens the reply may still take."""
    auto = parse_speculative("draft:fake")
    costs, drafting = PassCosts(), DraftCosts(prior_share=0.1)
    budget = DraftBudget(auto, costs, drafting)
    costs.record_step(0.010)
    for k in range(1, 9):
        costs.record_pass(k, 0.010 * (1 + 0.1 * k))
    drafting.record(4, 0.004)
    for _ in range(10):
        budget.record(4, 3)
    k = budget.k()
    assert k >= 1
    assert budget.pays_back(1, k, 5) and budget.pays_back(2, k, 5)  # caught up: no read
    assert budget.pays_back(500, k, None)  # no limit known: the read is spread over it
    drafting.record_read(100, 0.1)  # 1 ms a token: a tenth of a model step
    assert not budget.pays_back(500, k, 4)  # 50 steps of reading for 4 tokens
    assert budget.pays_back(500, k, 4000)
    assert DraftBudget(parse_speculative("draft:fake:3"), costs, drafting).pays_back(500, 3, 4)


def test_a_draft_times_a_batched_read_at_load_and_starts_empty() -> None:
    """A draft that a long prompt keeps from reading would never measure a read: it is
    timed at load, and the draft's cache is left empty."""
    draft = CopyingBackend(boost=2.0)
    drafter = DraftModel(draft, name="d")
    assert drafter.costs.read_s > 0
    assert drafter.n_past == 0 and draft.n_past == 0
    assert drafter.behind([1, 2, 3]) == 4


# -- the draft's cache, step by step -------------------------------------------------------


def _greedy(backend: CopyingBackend, window: Sequence[int], k: int) -> list[int]:
    """k greedy tokens after ``window`` from a fresh copy of the draft."""
    fresh = CopyingBackend(boost=backend._boost)
    logits = fresh.prefill(list(window))
    out = []
    for _ in range(k):
        out.append(int(np.argmax(logits)))
        if out[-1] == EOS:
            break
        logits = fresh.decode(out[-1])
    return out


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 6),
                          st.booleans()), min_size=1, max_size=12))  # fmt: skip
@settings(max_examples=150, deadline=None)
def test_proposals_are_what_a_fresh_draft_would_propose(steps: list[tuple[int, int, int, bool]]):
    """Whatever the target's cache does between proposals (keeps some drafts, slides, starts a
    new prompt), each proposal is the draft's greedy continuation of the target's tokens and
    the draft's cache holds exactly what it believes it holds."""
    draft = CopyingBackend(boost=2.0)
    drafter = DraftModel(draft, name="d")
    cached = [1, 2, 3, 1, 2]
    pending, proposed = 3, []
    for kept, cut, k, restart in steps:
        if restart:
            cached, pending = [4, 5, 4][: 1 + cut], 5
        else:  # the target kept some drafts, then read its own token
            cached = [*cached, pending, *proposed[:kept]][: max(1, len(cached) + 1 + kept - cut)]
            pending = (sum(cached) + kept) % 7
        proposed = drafter.propose(cached, pending, k)
        assert proposed == _greedy(draft, [*cached, pending], k)
        assert draft.cache == drafter._tokens
        assert draft.cache[: len(cached) + 1] == [*cached, pending]


# -- the setting ---------------------------------------------------------------------------


@given(st.text(max_size=60), st.one_of(st.none(), st.integers(-3, MAX_DRAFT + 3)))
@settings(max_examples=300, deadline=None)
def test_a_draft_setting_names_a_model_or_is_refused_in_a_typed_error(
    name: str, count: int | None
) -> None:
    value = f"draft:{name}" + ("" if count is None else f":{count}")
    try:
        parsed = parse_speculative(value)
    except InvalidRequestError as exc:
        assert str(exc).startswith("speculative=")
        return
    assert isinstance(parsed, SpeculativeConfig) and parsed.method == "draft"
    assert parsed.draft and "\x00" not in parsed.draft
    assert 1 <= parsed.max_draft <= MAX_DRAFT
    if count is not None and 1 <= count <= MAX_DRAFT:
        assert parsed.draft == name and parsed.max_draft == count and not parsed.adaptive


@pytest.mark.parametrize("value", ["draft:", "draft::3", "draft:m:0", "draft:m:17", "draft:a\x00b",
                                   "draft:\ud800", "draft:" + "x" * 5000])  # fmt: skip
def test_draft_settings_refused(value: str) -> None:
    with pytest.raises(InvalidRequestError, match="speculative="):
        parse_speculative(value)


def test_a_path_with_colons_is_one_name() -> None:
    assert parse_speculative("draft:C:/models/d.gguf").draft == "C:/models/d.gguf"
    assert parse_speculative("draft:C:/models/d.gguf:4").max_draft == 4
    assert parse_speculative("draft:qwen2.5-coder-0.5b-instruct").adaptive


# -- two tiny GGUFs of one vocabulary ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """target (2 layers), draft (1 layer, the same first layer), and drafts of other
    vocabularies: two tokens swapped, a token's type changed, two merges swapped."""
    folder = tmp_path_factory.mktemp("spec-draft")
    paths = {
        "target": ggufgen.tiny_llama(seed=3).write(folder / "target.gguf"),
        "draft": ggufgen.tiny_llama(seed=3, layers=1).write(folder / "draft.gguf"),
    }
    for name, change in (("tokens", _swap_tokens), ("types", _retype), ("merges", _swap_merges)):
        model = ggufgen.tiny_llama(seed=3, layers=1)
        change(model.metadata)
        paths[name] = model.write(folder / f"{name}.gguf")
    return paths


def _swap_tokens(meta: dict[str, ggufgen.Value]) -> None:
    tokens = list(meta["tokenizer.ggml.tokens"].value[1])
    tokens[260], tokens[261] = tokens[261], tokens[260]
    meta["tokenizer.ggml.tokens"] = ggufgen.Value(ggufgen.ARRAY, (ggufgen.STRING, tokens))


def _retype(meta: dict[str, ggufgen.Value]) -> None:
    types = list(meta["tokenizer.ggml.token_type"].value[1])
    types[100] = 4  # user-defined
    meta["tokenizer.ggml.token_type"] = ggufgen.Value(ggufgen.ARRAY, (ggufgen.I32, types))


def _swap_merges(meta: dict[str, ggufgen.Value]) -> None:
    merges = list(meta["tokenizer.ggml.merges"].value[1])
    merges[3], merges[4] = merges[4], merges[3]
    meta["tokenizer.ggml.merges"] = ggufgen.Value(ggufgen.ARRAY, (ggufgen.STRING, merges))


@pytest.fixture(scope="module")
def onnx(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """target, draft and the swapped-tokens draft converted by the native builder."""
    from edgeinfer.cli import main as cli_main

    out = tmp_path_factory.mktemp("spec-draft-onnx")
    folders = {}
    for name in ("target", "draft", "tokens"):
        folders[name] = out / name
        argv = ["convert", str(tiny[name]), "-o", str(folders[name]), "--threads", "1"]
        assert cli_main(argv) == 0
    return folders


@pytest.fixture(scope="module", params=["llama.cpp", "onnxruntime"])
def pair(request: pytest.FixtureRequest, tiny: dict[str, Path], onnx: dict[str, Path]):
    """(target, draft) on one engine."""
    files = tiny if request.param == "llama.cpp" else onnx
    return files["target"], files["draft"]


REAL_PROMPTS = [p * 2 for p in PROMPTS[:5]]


def _load(target: Path, spec: str, **kw: Any) -> Model:
    return edgeinfer.load(target, threads=1, context_length=256, speculative=spec, **kw)


def _greedy_kw(model: Model) -> dict[str, Any]:
    eos = model.tokenize("<|endoftext|>", parse_special=True)[0]
    return {"max_new_tokens": 40, "temperature": 0, "logit_bias": {eos: float("-inf")}}


def _check_beyond_noise(model: Model, prompt: str, plain: Sequence[int], fast: Sequence[int]):
    """Where the tokens part, plain decoding's top two must be within the kernels' noise (a
    pass over several positions may run other kernels than a one-token step)."""
    at = next((i for i, (a, b) in enumerate(zip(plain, fast, strict=False)) if a != b), None)
    if at is None:
        assert len(plain) == len(fast)
        return
    backend = model._backend
    backend.rewind(0)
    model._history.tokens.clear()
    model._history.batched = 0
    logits = backend.prefill(model.tokenize(prompt) + list(plain[:at]))
    top2 = np.sort(np.asarray(logits, dtype=np.float64))[-2:]
    assert top2[1] - top2[0] < 1e-3, (prompt, at)


def test_real_engines_give_plain_greedy_tokens_with_a_draft(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    with _load(target, f"draft:{draft}:4") as model:
        kw, drafted = _greedy_kw(model), 0
        for prompt in REAL_PROMPTS:
            plain = model.generate(prompt, speculative="off", **kw)
            fast = model.generate(prompt, **kw)
            drafted += fast.stats.draft_tokens
            _check_beyond_noise(model, prompt, plain.token_ids, fast.token_ids)
        assert drafted > 0
        assert model.info["speculative"]["draft"] == str(draft)


def test_the_target_as_its_own_draft_keeps_its_drafts(pair: tuple[Path, Path]) -> None:
    """The strongest exactness check: the same model drafting greedily and verifying
    greedily agrees on every draft, up to the kernels' noise between one-token steps and a
    pass over several positions."""
    target, _ = pair
    with _load(target, f"draft:{target}:4") as model:
        kw, drafted, accepted = _greedy_kw(model), 0, 0
        for prompt in REAL_PROMPTS:
            plain = model.generate(prompt, speculative="off", **kw)
            fast = model.generate(prompt, **kw)
            _check_beyond_noise(model, prompt, plain.token_ids, fast.token_ids)
            drafted += fast.stats.draft_tokens
            accepted += fast.stats.accepted_tokens
        assert drafted >= 100 and accepted >= 0.95 * drafted, (accepted, drafted)


@pytest.mark.parametrize(("other", "where"), [("tokens", "token id 260"),
                                              ("types", "token id 100 has type 1 against 4"),
                                              ("merges", "merge 3")])  # fmt: skip
def test_a_draft_of_another_vocabulary_is_refused_naming_both(
    tiny: dict[str, Path], other: str, where: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        _load(tiny["target"], f"draft:{tiny[other]}")
    message = str(caught.value)
    assert where in message and "target.gguf" in message and f"{other}.gguf" in message


def test_onnx_folders_and_mixed_formats_compare_their_vocabularies(
    tiny: dict[str, Path], onnx: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequestError, match="token id 260"):
        _load(onnx["target"], f"draft:{onnx['tokens']}")  # two tokenizer.json files
    with pytest.raises(InvalidRequestError, match="token id 260"):
        _load(tiny["target"], f"draft:{onnx['tokens']}")  # opened tokenizers, id by id
    hostile = tmp_path / "hostile"
    shutil.copytree(onnx["draft"], hostile)
    for text, error in (('{"model": {"vocab": 3}, "added_tokens": true}', InvalidRequestError),
                        ("{not json", edgeinfer.ModelLoadError)):  # fmt: skip
        (hostile / "tokenizer.json").write_text(text)
        with pytest.raises(error, match=r"vocabulary|tokenizer\.json"):
            _load(onnx["target"], f"draft:{hostile}")
    with _load(tiny["target"], f"draft:{onnx['draft']}:3") as model:  # the same vocabulary
        kw = _greedy_kw(model)
        plain = model.generate(REAL_PROMPTS[1], speculative="off", **kw)
        fast = model.generate(REAL_PROMPTS[1], **kw)
        _check_beyond_noise(model, REAL_PROMPTS[1], plain.token_ids, fast.token_ids)
        assert fast.stats.draft_tokens > 0


def test_the_memory_plan_counts_the_draft(tiny: dict[str, Path]) -> None:
    target, draft = (shape_of(resolve(tiny[n])) for n in ("target", "draft"))
    kw = {"budget": "64GB", "context_length": 256, "process": 10**8, "threads": 1}
    alone, both = plan_memory(target, **kw), plan_memory(target, draft=draft, **kw)
    assert both.total - alone.total >= both.draft >= draft.weight_bytes + both.draft_kv
    assert both.draft_kv == draft.kv_bytes_per_token * 256 and both.context_length == 256
    assert "draft model" in both.describe()
    with _load(tiny["target"], f"draft:{tiny['draft']}") as model:
        plan, info = model.info["memory_plan"], model.info["speculative"]
        assert plan["draft"] == info["draft_memory"] > draft.weight_bytes
        assert plan["total"] >= plan["draft"] + plan["kv_cache"]


def test_a_budget_without_room_for_the_draft_is_refused_before_anything_opens(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgeinfer import loader

    target, draft = (shape_of(resolve(tiny[n])) for n in ("target", "draft"))
    both = plan_memory(target, draft=draft, budget="64GB", context_length=256, threads=1)
    opened: list[Any] = []
    real_open = loader._open
    monkeypatch.setattr(loader, "_open", lambda *a: opened.append(a) or real_open(*a))
    budget = both.total - both.draft // 2  # the target alone fits, with the draft it does not
    with pytest.raises(MemoryBudgetError) as caught:
        _load(tiny["target"], f"draft:{tiny['draft']}", memory_budget=budget)
    message = str(caught.value)
    assert "draft model" in message and "weights" in message and "MB" in message
    assert "speculative='auto'" in message
    assert opened == []  # refused from the plan: no engine was opened


def test_a_draft_model_at_parallel_2_drafts_for_a_sequence_running_alone(
    tiny: dict[str, Path],
) -> None:
    """At parallel > 1 the draft model serves the sequence that runs alone (beside other
    streams it steps aside); its greedy tokens are plain decoding's, as at one slot."""
    with _load(tiny["target"], f"draft:{tiny['draft']}:4", parallel=2) as model:
        assert model.parallel == 2
        kw, drafted = _greedy_kw(model), 0
        for prompt in REAL_PROMPTS:
            plain = model.generate(prompt, speculative="off", **kw)
            fast = model.generate(prompt, **kw)
            drafted += fast.stats.draft_tokens
            _check_beyond_noise(model, prompt, plain.token_ids, fast.token_ids)
        assert drafted > 0


def test_a_draft_is_a_load_time_thing(tiny: dict[str, Path]) -> None:
    with pytest.raises(edgeinfer.ModelLoadError, match="the draft model"):
        _load(tiny["target"], "draft:/no/such/draft.gguf")
    with _load(tiny["target"], f"draft:{tiny['draft']}") as model:
        with pytest.raises(InvalidRequestError, match="loaded with the draft model"):
            model.generate("hi", speculative=f"draft:{tiny['target']}")
        drafter = model._spec.drafter
    assert drafter._closed and drafter.backend._model is None  # closed with its target


# -- processes ------------------------------------------------------------------------------


def _run(tiny: dict[str, Path], *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "edgeinfer", "run", str(tiny["target"]), "-p", PROMPTS[1] * 2,
            "-n", "16", "--temperature", "0", "--threads", "1", "--json", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_the_cli_takes_a_draft_and_refuses_a_bad_one_in_one_line(tiny: dict[str, Path]) -> None:
    plain = json.loads(_run(tiny).stdout)
    fast = json.loads(_run(tiny, "--speculative", f"draft:{tiny['draft']}:4").stdout)
    assert fast["token_ids"] == plain["token_ids"] and fast["stats"]["draft_tokens"] > 0
    for bad in ("draft:/no/such.gguf", f"draft:{tiny['merges']}", "draft:x:99"):
        failed = _run(tiny, "--speculative", bad)
        assert failed.returncode == 1, failed.stderr
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: "), failed.stderr


@pytest.fixture(scope="module")
def server(tiny: dict[str, Path]) -> Iterator[Any]:
    from .test_serve import _start

    yield from _start(tiny["target"], "--speculative", f"draft:{tiny['draft']}:4")


def test_the_server_runs_its_draft_and_refuses_another_alive(server: Any) -> None:
    import openai

    client = server.client()
    kw = {"model": server.model, "prompt": PROMPTS[1] * 2, "max_tokens": 24, "temperature": 0,
          "logit_bias": {"266": -100}}  # fmt: skip
    plain = client.completions.create(**kw, extra_body={"speculative": "off"})
    for bad in ("draft:/other.gguf", "draft:" + "y" * 5000, "draft:a\x00b"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**kw, extra_body={"speculative": bad})
        assert isinstance(caught.value.body, dict) and caught.value.body.get("param") == (
            "speculative"
        )
    drafted = client.completions.create(**kw)  # the server's default: its draft
    assert drafted.choices[0].text == plain.choices[0].text
    assert server.process.poll() is None


# -- the real pair ---------------------------------------------------------------------------

CODE_PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci "
                                 "number iteratively."}],
    [{"role": "user", "content": "Tell me about the history of the city of Lyon."}],
    [{"role": "user", "content": "Rename the variable x to count:\n\nx = 0\nfor item in items:"
                                 "\n    x += 1\nprint(x)"}],
]  # fmt: skip


@pytest.mark.model
def test_the_05b_draft_on_the_15b_target_gives_plain_greedy_tokens() -> None:
    with edgeinfer.load("qwen2.5-coder-1.5b-instruct", engine="llama.cpp", context_length=1024,
                        speculative="draft:qwen2.5-coder-0.5b-instruct:4") as model:  # fmt: skip
        drafted = accepted = 0
        for messages in CODE_PROMPTS:
            plain = model.chat(messages, max_new_tokens=32, temperature=0, speculative="off")
            fast = model.chat(messages, max_new_tokens=32, temperature=0)
            assert fast.token_ids == plain.token_ids, messages
            drafted += fast.stats.draft_tokens
            accepted += fast.stats.accepted_tokens
            print(f"drafted {fast.stats.draft_tokens}, kept {fast.stats.accepted_tokens}")
        assert drafted > 0
        print(f"acceptance {accepted}/{drafted} = {accepted / drafted:.2f}")
        assert model.info["speculative"]["draft_memory"] > 400e6  # the 0.5B's weights at least


# -- the vocabulary comparison, over any arrays ---------------------------------------------

_TOKEN = st.binary(min_size=1, max_size=5)


def _vocab_file(
    folder: Path, name: str, tokens: list[bytes], types: list[int], merges: list[bytes]
):
    from edgeinfer.files.gguf_file import read_gguf_header
    from edgeinfer.files.source import ModelSource

    meta = {
        "general.architecture": ggufgen.Value(ggufgen.STRING, "llama"),
        "tokenizer.ggml.tokens": ggufgen.Value(ggufgen.ARRAY, (ggufgen.STRING, tokens)),
        "tokenizer.ggml.token_type": ggufgen.Value(ggufgen.ARRAY, (ggufgen.I32, types)),
        "tokenizer.ggml.merges": ggufgen.Value(ggufgen.ARRAY, (ggufgen.STRING, merges)),
    }
    path = ggufgen.Model(meta).write(folder / f"{name}.gguf")
    return ModelSource(name, path, "gguf", read_gguf_header(path))


@given(st.data())
@settings(max_examples=120, deadline=None)
def test_two_gguf_vocabularies_part_exactly_where_their_arrays_do(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    from edgeinfer.generation.draft_vocab import check_files

    tokens = data.draw(st.lists(_TOKEN, min_size=1, max_size=24), label="tokens")
    types = data.draw(st.lists(st.integers(1, 6), min_size=len(tokens), max_size=len(tokens)))
    merges = data.draw(st.lists(_TOKEN, max_size=6), label="merges")
    other = list(tokens)
    changed = data.draw(st.one_of(st.none(), st.integers(0, len(tokens) - 1)), label="changed")
    if changed is not None:
        other[changed] = data.draw(_TOKEN, label="replacement")
    other += data.draw(st.lists(_TOKEN, max_size=2), label="extra")
    other_types = types + [1] * (len(other) - len(tokens))
    folder = tmp_path_factory.mktemp("vocab")
    a = _vocab_file(folder, "a", tokens, types, merges)
    b = _vocab_file(folder, "b", other, other_types, merges)
    first = next((i for i, (x, y) in enumerate(zip(tokens, other, strict=False)) if x != y), None)
    if first is None and len(other) == len(tokens):
        assert check_files(a, b, "draft:b") is True  # the same vocabulary: accepted
        return
    with pytest.raises(InvalidRequestError) as caught:
        check_files(a, b, "draft:b")
    message = str(caught.value)
    assert "draft model b" in message and "vocabulary of a" in message
    if first is not None:
        assert f"token id {first} has {tokens[first]!r} against {other[first]!r}" in message


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=16,
)


@given(_JSON, _JSON)
@settings(max_examples=300, deadline=None)
def test_any_tokenizer_json_is_read_or_refused_in_a_typed_error(a: Any, b: Any) -> None:
    """A stranger's tokenizer.json of any shape: compared, never a crash."""
    from edgeinfer.generation.draft_vocab import _json_merges, _json_tokens

    for data in (a, b, {"model": a, "added_tokens": b}, {"model": {"vocab": a, "merges": b}}):
        assert isinstance(_json_tokens(data), dict)
        assert isinstance(_json_merges(data), list)
