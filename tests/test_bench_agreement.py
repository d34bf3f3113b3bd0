"""``edgeinfer bench --agreement``: each engine row's answers against llama.cpp on the source
GGUF, measured in the same run, carried by the table, the JSON and a saved report; a damaged
agreement record in a saved report is refused in one line."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.bench.report import BenchReport

from .test_bench_hostile import json_values, load, paths, saved_report

FIGURES = {"positions": 128, "top1_agreement": 0.9, "decisive_positions": 40,
           "decisive_top1_agreement": 1.0, "greedy_agreement": 0.5,
           "greedy_agreement_beyond_ties": 1.0, "mean_greedy_prefix": 8.0, "mean_kl": 0.01,
           "relative_kl": 0.001}  # fmt: skip


def with_agreement() -> dict[str, Any]:
    data = saved_report()
    data["agreement"] = {
        "reference": "m.gguf",
        "prompts": 8,
        "engines": [
            {"engine": "edgeinfer", "engine_model": "/m.gguf", "provider": "llama.cpp:CPU",
             **FIGURES},
            {"engine": "llama-cpp-python", "engine_model": "/m.gguf", "error": "it failed"},
        ],
    }  # fmt: skip
    return data


BASE = with_agreement()
AGREEMENT_PATHS = [p for p in paths(BASE) if p[:1] == ("agreement",)]


@st.composite
def damaged_agreement(draw: st.DrawFn) -> bytes:
    """The saved report with one value of its agreement record replaced, or removed."""
    data = copy.deepcopy(BASE)
    path = draw(st.sampled_from(AGREEMENT_PATHS))
    parent: Any = data
    for key in path[:-1]:
        parent = parent[key]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_values)
    return json.dumps(data).encode()


def test_a_report_carries_agreement_in_table_json_and_back() -> None:
    report = BenchReport.from_dict(copy.deepcopy(BASE))
    table = report.text()
    assert "top-1 vs ref" in table and "greedy prefix" in table and "90.0%" in table
    assert "agreement not measured for llama-cpp-python: it failed" in table
    rows = report.to_dict()["results"]
    ours = [r["agreement"] for r in rows if r["engine"] == "edgeinfer"]
    assert ours and all(a["top1_agreement"] == 0.9 for a in ours)
    assert all(r["agreement"] is None for r in rows if r["engine"] != "edgeinfer")
    again = BenchReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.text() == table


def test_an_edgeinfer_row_takes_only_figures_of_its_own_route() -> None:
    data = copy.deepcopy(BASE)
    data["agreement"]["engines"][0]["provider"] = "CPUExecutionProvider"
    report = BenchReport.from_dict(data)
    assert all(report.agreement_of(r) is None for r in report.measured())


def test_a_report_without_agreement_has_no_columns() -> None:
    data = saved_report()
    assert "top-1 vs ref" not in BenchReport.from_dict(data).text()


@settings(max_examples=150, deadline=None)
@given(damaged_agreement())
def test_a_damaged_agreement_record_loads_whole_or_is_refused(data: bytes) -> None:
    got = load(data)
    if not isinstance(got, BenchReport):
        message = str(got)
        assert "\n" not in message and message.isprintable() and "r.json" in message
        return
    got.text()
    got.text(markdown=True)
    json.dumps(got.to_dict(), allow_nan=False)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(damaged_agreement())
def test_damaged_agreement_through_the_real_command(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(data)
    out = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "bench", "--from", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in out.stderr and out.returncode in (0, 1), out.stderr
    if not isinstance(load(data), BenchReport):
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith(f"edgeinfer: error: --from {path}"), line


@pytest.mark.parametrize("flags", [["--reference", "/no/such.gguf", "--agreement"],
                                   ["--reference", "."]])  # fmt: skip
def test_a_bad_reference_is_one_line(flags: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "bench", "m.gguf", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "--reference" in line


def test_every_row_of_a_real_run_gets_its_agreement(tmp_path: Path) -> None:
    """llama.cpp's own rows agree fully with llama.cpp; the ONNX folder built from the same
    file is measured beside them, in the same process run."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    from .test_validate_ties import flat_llama

    gguf = flat_llama(0.3, 2, 0).write(tmp_path / "m.gguf")
    folder = tmp_path / "onnx"
    folder.mkdir()
    write_gguf_folder(gguf, folder, quant="keep")
    common = ["-p", "16", "-n", "4", "-r", "1", "--warmup", "0", "--threads", "1",
              "--context-length", "256", "--compare", "--agreement", "--json"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "bench", str(folder), *common,
         "--reference", str(gguf), "--peer-model", str(gguf)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = {r["engine"]: r["agreement"] for r in report["results"]}
    assert set(rows) == {"edgeinfer", "llama-cpp-python"}
    # the same engine on the same file: at most near-ties part it from the reference
    assert rows["llama-cpp-python"]["decisive_top1_agreement"] == 1.0
    assert rows["llama-cpp-python"]["greedy_agreement_beyond_ties"] == 1.0
    assert 0.0 <= rows["edgeinfer"]["top1_agreement"] <= 1.0
    assert rows["edgeinfer"]["decisive_top1_agreement"] == 1.0  # a correct graph
    assert BenchReport.from_dict(report).text().count("%") >= 2


def test_optimums_row_gets_its_agreement(tiny_llama_onnx: Path, tiny_llama_gguf: Path) -> None:
    """optimum's own runtime on its fp32 export of the checkpoint the f32 GGUF was written
    from: the same numbers up to float rounding, so every decisive position agrees."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("optimum.onnxruntime")
    common = ["-p", "16", "-n", "4", "-r", "1", "--warmup", "0", "--threads", "1",
              "--context-length", "256", "--compare", "--agreement", "--json"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "bench", str(tiny_llama_onnx), *common,
         "--reference", str(tiny_llama_gguf)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = {r["engine"]: r.get("agreement") for r in report["results"]}
    assert rows.get("optimum") is not None, report.get("notes")
    assert rows["optimum"]["decisive_top1_agreement"] == 1.0
    assert rows["optimum"]["greedy_agreement_beyond_ties"] == 1.0
    assert rows["edgeinfer"]["decisive_top1_agreement"] == 1.0
