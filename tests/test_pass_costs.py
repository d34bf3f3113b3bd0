"""A model's pass costs (edgeinfer.generation.pass_costs): timed at load when its requests
speculate by default, interpolated between the k that were timed, the cache left empty."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import edgeinfer
from edgeinfer import EdgeInferError
from edgeinfer.generation.pass_costs import PassCosts
from edgeinfer.generation.speculative import parse_speculative
from edgeinfer.model import Model

from .test_speculative import PROMPTS, CopyingBackend
from .test_speculative_real import CTX, model_path, tiny_gguf  # noqa: F401 (fixtures: both engines)


def test_a_pass_never_timed_is_interpolated_between_the_nearest_timed_ones() -> None:
    costs = PassCosts(step_s=0.010, pass_s={1: 0.012, 4: 0.018, 8: 0.026})
    assert costs.ratio(1) == pytest.approx(1.2)
    assert costs.ratio(2) == pytest.approx(1.4)  # a third of the way from k=1 to k=4
    assert costs.ratio(6) == pytest.approx(2.2)
    assert costs.ratio(12) == pytest.approx(3.4)  # beyond k=8: along the last slope
    below = PassCosts(step_s=0.010, pass_s={4: 0.018})
    assert below.ratio(2) == pytest.approx(1.4)  # towards a step at k=0
    assert PassCosts().ratio(4) == pytest.approx(2.0)  # nothing timed: the guess
    assert PassCosts(step_s=0.010, pass_s={1: 0.002}).ratio(1) == 1.0  # never below a step


class _Counting(CopyingBackend):
    """The copying fake, counting its one-token steps and passes by length."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def forward(self, token_ids):  # type: ignore[no-untyped-def]
        self.lengths.append(len(token_ids))
        return super().forward(token_ids)


def _model(backend: CopyingBackend, setting: str | None) -> Model:
    spec = parse_speculative(setting) if setting else None
    return Model(backend, name="c", path=Path("c"), model_format="fake", speculative=spec)


def test_a_model_that_speculates_adaptively_times_its_passes_at_load_leaving_its_cache_empty() -> (
    None
):
    backend = _Counting()
    model = _model(backend, "auto")
    assert set(model._costs.pass_s) == {1, 4, 8}
    assert model._costs.step_s > 0
    assert {n - 1 for n in backend.lengths} == {1, 4, 8}
    assert backend.cache == []  # the slot is as load() left it


@pytest.mark.parametrize("setting", [None, "off", "lookup", "lookup:3"])
def test_a_setting_that_never_reads_the_costs_times_nothing(setting: str | None) -> None:
    """Off, or a fixed draft length ("lookup" drafts whatever the costs say)."""
    backend = _Counting()
    model = _model(backend, setting)
    assert model._costs.step_s == 0 and not model._costs.pass_s and backend.passes == 0


class _Refusing(_Counting):
    """A fake whose passes over more than ``longest`` tokens fail as an engine's typed error
    would (a pass longer than it reads at once)."""

    def __init__(self, longest: int = 0) -> None:
        super().__init__()
        self.longest = longest

    def forward(self, token_ids):  # type: ignore[no-untyped-def]
        if len(token_ids) > self.longest:
            raise EdgeInferError("no passes this long here")
        return super().forward(token_ids)


class _Broken(_Counting):
    """A fake whose passes fail with an error no engine should raise."""

    def forward(self, token_ids):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in an engine")


def test_a_pass_the_engine_refuses_is_left_out_and_the_others_are_timed() -> None:
    backend = _Refusing(longest=5)
    model = _model(backend, "auto")
    assert set(model._costs.pass_s) == {1, 4} and model._costs.step_s > 0
    assert backend.cache == []


@pytest.mark.parametrize("backend", [CopyingBackend(n_ctx=24), _Refusing(), _Broken()],
                         ids=["context too short", "passes refused", "engine error"])  # fmt: skip
def test_a_model_whose_passes_cannot_be_timed_still_loads_and_learns_them_later(
    backend: CopyingBackend,
) -> None:
    model = _model(backend, "auto")
    assert not model._costs.pass_s  # the guess stands in until requests run
    assert model._costs.ratio(4) == pytest.approx(2.0)
    assert backend.cache == []


def _replies(model: Any) -> list[tuple[int, ...]]:
    """Greedy replies with drafting off and with a fixed draft length (which never reads
    the timed costs, so its drafts, and its tokens, cannot depend on them)."""
    return [model.generate(p * 2, max_new_tokens=24, temperature=0, speculative=s).token_ids
            for p in PROMPTS[:4] for s in ("off", "lookup:4")]  # fmt: skip


@pytest.mark.parametrize("parallel", [1, 2])
def test_timing_at_load_leaves_nothing_behind_on_a_real_engine(
    model_path: Path,  # noqa: F811 (the fixture imported above: both engines)
    parallel: int,
) -> None:
    """A model loaded with "auto" times its passes in slot 0 and leaves every slot empty;
    its replies are those of a model loaded without it."""
    options: dict[str, Any] = {"threads": 1, "context_length": CTX, "parallel": parallel}
    with edgeinfer.load(model_path, speculative="auto", **options) as timed:
        assert set(timed._costs.pass_s) == {1, 4, 8} and timed._costs.step_s > 0
        backend = timed._backend
        slots = range(parallel)
        pasts = [backend.slot_past(s) for s in slots] if parallel > 1 else [backend.n_past]
        assert pasts == [0] * parallel
        got = _replies(timed)
    with edgeinfer.load(model_path, **options) as plain:
        assert plain._costs.step_s == 0
        want = _replies(plain)
    assert got == want


def test_chat_on_the_command_line_speculates_and_says_so(tmp_path: Path) -> None:
    """``edgeinfer chat --speculative lookup``: the replies of plain decoding, and /stats
    says how many tokens were drafted and kept."""
    from .test_serve_speculative import write_tiny

    model = write_tiny(tmp_path / "t.gguf")
    script = "the cat sat on the mat. the cat sat on the mat. the cat sat\n/stats\n/exit\n"
    base = [sys.executable, "-m", "edgeinfer", "chat", str(model), "--temperature", "0",
            "-n", "24", "--threads", "1"]  # fmt: skip

    def chat(*extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*base, *extra], input=script, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    plain, fast = chat(), chat("--speculative", "lookup")
    assert fast.stdout == plain.stdout and plain.stdout.strip()
    assert "drafted" in fast.stderr and "drafted" not in plain.stderr
