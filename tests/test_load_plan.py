"""Values made once at the boundary, and one set of plan rules (issue: one generation core).

- ``memory_budget`` becomes a ``MemoryBudget`` where ``load()`` takes it: an invalid one is
  refused before the model is even looked up.
- One default budget: the process plus half of the RAM available, for generative and
  embedding models alike.
- ``edgeinfer devices MODEL --inventory RECORD`` plans by ``load()``'s rules
  (``edgeinfer.load_plan``): for this machine's own record it takes the route ``load()``
  takes here and plans the same model file (its weights, cache and batch), and where a
  budget keeps a catalog GGUF on llama.cpp it says so as ``load()`` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import edgeinfer
from edgeinfer import cli
from edgeinfer.errors import InvalidRequestError
from edgeinfer.files.catalog import DEFAULT_MODEL
from edgeinfer.loader import resolve
from edgeinfer.memory.budget import DEFAULT_BUDGET_FRACTION
from edgeinfer.memory.plan import MemoryBudget, plan_memory
from edgeinfer.memory.shape import shape_of


@pytest.mark.parametrize("bad", ["lots", "-5MB", 0, True, "1.5XB"])
def test_an_invalid_budget_is_refused_before_the_model_is_looked_up(bad: Any) -> None:
    with pytest.raises(InvalidRequestError, match="memory_budget"):
        edgeinfer.load("no-such-model-anywhere", memory_budget=bad)


def test_a_budget_is_made_once_and_kept() -> None:
    made = MemoryBudget.of("1.5GiB")
    assert made == MemoryBudget(3 * 2**29) and MemoryBudget.of(made) is made
    assert made.resolve(process=10**9, available=1) == (3 * 2**29, "memory_budget")
    limit, why = MemoryBudget.of(None).resolve(process=100, available=1000)
    assert limit == 100 + int(1000 * DEFAULT_BUDGET_FRACTION) and "1000" not in why


def test_embedding_and_generative_plans_share_the_default_budget(
    default_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgeinfer.embedding.load import plan_embedding_memory

    class Memory:
        available = 8 * 10**9

    monkeypatch.setattr("edgeinfer.memory.budget.psutil.virtual_memory", lambda: Memory)
    process = 200 * 10**6
    want = process + int(Memory.available * DEFAULT_BUDGET_FRACTION)
    plan = plan_memory(shape_of(resolve(default_gguf)), process=process)
    assert plan.budget - plan.process == want - process  # the import cost rides on both sides
    config = SimpleNamespace(max_position_embeddings=512)
    encoder = SimpleNamespace(weight_bytes=10**6, max_seq_length=128, config=config)
    monkeypatch.setattr("edgeinfer.embedding.load.activation_bytes", lambda folder: 10**5)
    embedding = plan_embedding_memory(encoder, None, 1, process=process)  # type: ignore[arg-type]
    assert embedding.budget == want
    assert embedding.budget_source == plan.budget_source


def _fresh_process(call: str) -> str:
    """The route ``edgeinfer.<call>`` takes in a fresh Python process, as JSON (a budget
    this small holds a fresh process, not this test process)."""
    code = f"import json, edgeinfer\nprint(json.dumps(edgeinfer.{call}.info['route']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def _devices_plan(record: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> Any:
    assert cli.main(["devices", DEFAULT_MODEL, "--inventory", str(record), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def this_machine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("record") / "this-machine.json"
    assert cli.main(["devices", "--record", str(out)]) == 0
    return out


def test_devices_plans_this_machines_record_as_load_does(
    this_machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    shown = _devices_plan(this_machine, capsys, "--context-length", "512")
    with edgeinfer.load(DEFAULT_MODEL, context_length=512) as model:
        info = model.info
    plan, loaded = shown["memory_plan"], info["memory_plan"]
    assert shown["route"]["format"] == info["route"]["format"]
    for key in ("weights", "kv_bytes_per_token", "batch_size", "context_length", "parallel"):
        assert plan[key] == loaded[key], key


def test_devices_keeps_a_gguf_on_llama_cpp_where_load_does(
    this_machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """256 MB: the transcode's plan does not fit, llama.cpp's does (load() routes so, and
    says why); the recorded machine's plan says the same."""
    capsys.readouterr()
    shown = _devices_plan(this_machine, capsys, "--memory-budget", "256MB")
    route = json.loads(_fresh_process(f"load({DEFAULT_MODEL!r}, memory_budget='256MB')"))
    assert route["format"] == "gguf" and "does not fit the budget" in route["why"]
    assert shown["route"]["format"] == "gguf" and "does not fit the budget" in shown["route"]["why"]
    assert shown["memory_plan"]["budget"] == 256 * 10**6


def test_a_transcode_that_cannot_be_written_names_the_fix(
    default_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgeinfer import load_plan
    from edgeinfer.errors import ModelLoadError

    def refuse(*args: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    monkeypatch.setattr(load_plan, "_build_native", refuse)
    source = resolve(default_gguf)
    source = type(source)(DEFAULT_MODEL, source.path, source.format, source.header)
    with pytest.raises(ModelLoadError, match="EDGEINFER_HOME to a writable folder"):
        load_plan.transcoded_catalog_model(source)
