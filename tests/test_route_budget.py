"""The route fits the budget: where the ONNX transcode's memory plan does not fit and the
GGUF's plan on llama.cpp does, a catalog model stays on llama.cpp and says why; the peak of
a fresh process stays under the budget."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import edgeinfer
from edgeinfer import MemoryBudgetError

CHILD = """
import json, sys, edgeinfer
from edgeinfer.memory.rss import peak_rss
with edgeinfer.load("smollm2-135m-instruct", memory_budget=sys.argv[1], threads=2) as m:
    r = m.generate("The capital of France is", max_new_tokens=16, temperature=0)
    print(json.dumps({"route": m.info["route"], "peak": peak_rss(), "n": len(r.token_ids),
                      "budget": m.info["memory_plan"]["budget"]}))
"""


def _load_in_a_fresh_process(budget: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, budget], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.model
@pytest.mark.parametrize("budget", ["256MB", "512MB"])
def test_a_catalog_model_loads_within_the_budget_on_a_route_that_fits(
    budget: str, default_gguf
) -> None:
    got = _load_in_a_fresh_process(budget)
    assert got["n"] > 0 and got["peak"] <= got["budget"]
    if got["route"]["format"] == "gguf":
        assert "does not fit the budget" in got["route"]["why"]


@pytest.mark.model
def test_at_256mb_the_transcode_does_not_fit_and_the_gguf_does(default_gguf) -> None:
    """The transcode plans more weights than its GGUF (onnxruntime's pre-packed copy)."""
    with pytest.raises(MemoryBudgetError):
        edgeinfer.load("smollm2-135m-instruct", memory_budget="256MB", engine="onnxruntime")
    got = _load_in_a_fresh_process("256MB")
    assert got["route"]["format"] == "gguf" and got["route"]["from"] == "gguf"


@pytest.mark.model
def test_an_engine_asked_for_is_never_swapped(default_gguf) -> None:
    with pytest.raises(MemoryBudgetError, match="budget"):
        edgeinfer.load("smollm2-135m-instruct", memory_budget="256MB", engine="onnxruntime")
