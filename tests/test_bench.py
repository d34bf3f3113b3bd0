"""``edgeinfer bench``: real runs on tiny models (every engine in a fresh process), the
runner's interleaving and failure handling with a recorded runner, and the outputs."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from edgeinfer.bench import BenchSettings, run_bench
from edgeinfer.bench.peers import peers_for
from edgeinfer.bench.report import BenchReport
from edgeinfer.bench.runner import ProgressLine, RunFailed
from edgeinfer.bench.worker import timings
from edgeinfer.errors import InvalidRequestError, ModelLoadError

from .leakcheck import KillAtEnd
from .signals import sigint_default

CLI = [sys.executable, "-m", "edgeinfer.cli", "bench"]
TINY = ["-p", "8,16", "-n", "4", "-r", "2", "--warmup", "0", "--context-length", "64"]
ONE_RUN = ["-p", "8", "-n", "4", "-r", "1", "--warmup", "0", "--context-length", "64"]


def bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


# -- the command on real (tiny) models -------------------------------------------------------


def test_compare_json_has_edgeinfer_and_llama_cpp_python_rows(tiny_llama_gguf: Path) -> None:
    out = bench(str(tiny_llama_gguf), *TINY, "--threads", "1,2", "--compare", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["schema"] == "edgeinfer.bench/1"
    assert report["machine"]["physical_cores"] >= 1 and report["versions"]["edgeinfer"]
    assert report["interrupted"] is False and report["errors"] == []
    rows = report["results"]
    configs = {(r["engine"], r["threads"], r["prompt_tokens"]) for r in rows}
    assert configs == {
        (e, t, p) for e in ("edgeinfer", "llama-cpp-python") for t in (1, 2) for p in (8, 16)
    }
    for row in rows:
        assert row["repetitions"] == 2 and len(row["runs"]) == 2
        assert row["tokens_generated_min"] == 4  # EOS banned: every engine generates -n
        for figure in ("pp_tok_s", "tg_tok_s", "ttft_ms", "peak_rss_mb"):
            s = row[figure]
            assert s["min"] <= s["median"] <= s["max"] and s["min"] > 0 and s["stddev"] >= 0
        assert row["context_length"] == 64
        ours = next(
            r
            for r in rows
            if r["engine"] == "edgeinfer"
            and (r["threads"], r["prompt_tokens"]) == (row["threads"], row["prompt_tokens"])
        )
        ratio = row["ratio_to_edgeinfer"]["tg_tok_s"]
        assert ratio == pytest.approx(row["tg_tok_s"]["mean"] / ours["tg_tok_s"]["mean"])
    ours = [r for r in rows if r["engine"] == "edgeinfer"]
    assert all(r["plan_total_mb"] > 0 and r["provider"].startswith("llama.cpp") for r in ours)
    assert all(r["ratio_to_edgeinfer"]["tg_tok_s"] == pytest.approx(1.0) for r in ours)
    # progress went to stderr, one line per run when stderr is not a terminal
    assert out.stderr.count("bench [") == 2 * 2 * 2 * 2


def test_table_and_markdown(tiny_llama_gguf: Path) -> None:
    out = bench(str(tiny_llama_gguf), *ONE_RUN)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("| model") and "tg t/s" in lines[0] and "TTFT ms" in lines[0]
    assert "pp8+tg4" in lines[2] and "edgeinfer" in lines[2]
    md = bench(str(tiny_llama_gguf), *ONE_RUN, "--markdown")
    assert md.returncode == 0, md.stderr
    assert md.stdout.startswith("`edgeinfer bench ")
    assert "| --- | --- |" in md.stdout and "mean ± stddev over 1 runs" in md.stdout


def test_speculative_rows_say_how_many_drafted_tokens_were_kept(tiny_llama_gguf: Path) -> None:
    args = ["-p", "32", "-n", "24", "-r", "1", "--warmup", "0", "--context-length", "128"]
    out = bench(str(tiny_llama_gguf), *args, "--speculative", "lookup:4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["settings"]["speculative"] == "lookup:4"
    (run,) = data["results"][0]["runs"]
    stats = run["engine_stats"]  # the workload's prompt repeats itself: lookup finds drafts
    assert stats["draft_tokens"] > 0 and 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
    table = BenchReport.from_dict(data).text()
    header, _, row = table.splitlines()[:3]
    assert header.rstrip(" |").endswith("accepted")
    assert f"{stats['accepted_tokens']}/{stats['draft_tokens']}" in row
    plain = bench(str(tiny_llama_gguf), *args, "--json")
    assert plain.returncode == 0, plain.stderr
    (run,) = json.loads(plain.stdout)["results"][0]["runs"]
    assert run["engine_stats"]["draft_tokens"] == 0
    assert "accepted" not in BenchReport.from_dict(json.loads(plain.stdout)).text()


def test_onnx_folder_compares_with_optimum(tiny_llama_onnx: Path) -> None:
    pytest.importorskip("optimum.onnxruntime")
    out = bench(str(tiny_llama_onnx), *ONE_RUN, "--compare", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["engine"]: r for r in json.loads(out.stdout)["results"]}
    assert set(rows) == {"edgeinfer", "optimum"}
    assert rows["optimum"]["tokens_generated_min"] == 4
    assert rows["edgeinfer"]["provider"] == "CPUExecutionProvider"


@pytest.mark.parametrize(
    "args, message",
    [
        (("-p", ""), "-p/--prompt-tokens '' is invalid"),
        (("-p", "128,,512"), "-p/--prompt-tokens '128,,512' is invalid"),
        (("-p", "0"), "-p/--prompt-tokens 0 is invalid"),
        (("--threads", ""), "--threads '' is invalid"),
        (("--threads", "2,x"), "--threads '2,x' is invalid"),
        (("-r", "0"), "-r/--repetitions 0 is invalid"),
        (("-n", "1"), "-n/--new-tokens 1 is invalid"),
        (("--warmup", "-1"), "--warmup -1 is invalid"),
        (("--context-length", "100"), "need 640 tokens"),
        (("--peer-model", "x.gguf"), "add --compare"),
        (("--speculative", "sometimes"), "speculative='sometimes' is invalid"),
    ],
)
def test_bad_arguments_are_one_line_errors(args: tuple[str, ...], message: str) -> None:
    out = bench("some-model", *args)
    assert out.returncode == 1 and out.stdout == ""
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_model_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    missing = bench(str(tmp_path / "none.gguf"))
    assert missing.returncode == 1 and "no such file" in missing.stderr
    bad = tmp_path / "bad.gguf"  # a GGUF header that lies about its tensor count
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0))
    for out in (missing, bench(str(bad), "-r", "1")):
        assert out.returncode == 1 and out.stdout == ""
        lines = [ln for ln in out.stderr.splitlines() if not ln.startswith("bench [")]
        assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: ")
        assert "Traceback" not in out.stderr


def test_ctrl_c_prints_what_was_measured(tiny_llama_gguf: Path, kill_at_end: KillAtEnd) -> None:
    proc = kill_at_end(subprocess.Popen(
        [*CLI, str(tiny_llama_gguf), *ONE_RUN, "-r", "500"],  # the last -r counts
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    ))  # fmt: skip
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + 120
    while "run 3/500" not in seen and time.monotonic() < deadline:
        seen += proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "edgeinfer" in out and "pp8+tg4" in out
    assert "interrupted" in out and "Traceback" not in err + seen


def test_plot_draws_a_png(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    out = bench(str(tiny_llama_gguf), *ONE_RUN, "--compare", "--json", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]  # no temporary left


def test_plot_without_matplotlib_says_how_to_add_it(tmp_path: Path) -> None:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [*CLI, "smollm2-135m-instruct", "--plot", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 1 and "pip install 'edgeinfer[bench]'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# -- the runner, with a recorded runner ------------------------------------------------------


class Recorded:
    """Stands in for the fresh process: records the order of runs and answers with figures."""

    def __init__(self, fail: dict[str, Exception] | None = None, stop_after: int = 0) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.fail = fail or {}
        self.stop_after = stop_after

    def __call__(self, spec: dict[str, Any]) -> dict[str, Any]:
        if self.stop_after and len(self.calls) >= self.stop_after:
            raise KeyboardInterrupt
        engine = spec["engine"]
        self.calls.append((engine, spec["threads"], spec["prompt_tokens"]))
        if engine in self.fail:
            raise self.fail[engine]
        if engine != "edgeinfer":
            assert spec["prompt_ids"] == list(range(spec["prompt_tokens"]))
            assert spec["ban_ids"] == [0]
        speed = 100.0 if engine == "edgeinfer" else 50.0
        return {
            "tokens": spec["new_tokens"],
            "ttft_s": 0.1,
            "prefill_tok_s": spec["prompt_tokens"] / 0.1,
            "decode_tok_s": speed + len(self.calls) % 3,
            "peak_rss_bytes": 200e6,
            "provider": "llama.cpp:CPU",
            "device": "cpu",
            "context_length": spec["context_length"],
            "plan_total_bytes": 250e6 if engine == "edgeinfer" else None,
            "prompt_ids": list(range(spec["prompt_tokens"])),
            "ban_ids": [0],
        }


class Quiet(ProgressLine):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def show(self, text: str) -> None:
        self.lines.append(text)

    def say(self, text: str) -> None:
        self.lines.append(text)

    def clear(self) -> None:
        pass


def settings(model: Path, **kw: Any) -> BenchSettings:
    base: dict[str, Any] = dict(
        models=(str(model),),
        prompt_tokens=(8, 16),
        new_tokens=4,
        repetitions=2,
        warmup=1,
        threads=(1, 2),
        compare=True,
    )
    return BenchSettings(**{**base, **kw})


def test_runs_interleave_round_by_round(tiny_llama_gguf: Path) -> None:
    runner = Recorded()
    report = run_bench(settings(tiny_llama_gguf), runner=runner, progress=Quiet(), machine={})
    engines = [c[0] for c in runner.calls]
    assert engines == ["edgeinfer", "llama-cpp-python"] * (2 * 2 * 3)
    assert [c[1:] for c in runner.calls[::2]] == [
        (t, p) for t in (1, 2) for p in (8, 16) for _ in range(3)
    ]
    rows = report.measured()
    assert len(rows) == 8 and all(len(r.runs) == 2 for r in rows)  # the warm-up not counted
    peer = next(r for r in rows if r.engine == "llama-cpp-python")
    assert report.ratio(peer, "tg_tok_s") == pytest.approx(
        peer.figure("tg_tok_s")["mean"]
        / next(r for r in rows if r.engine == "edgeinfer" and r.key == peer.key).figure("tg_tok_s")[
            "mean"
        ]
    )


def test_a_failing_peer_is_left_out_with_a_note(tiny_llama_gguf: Path) -> None:
    runner = Recorded(fail={"llama-cpp-python": RunFailed("crash", "killed by signal 11")})
    report = run_bench(settings(tiny_llama_gguf), runner=runner, progress=Quiet(), machine={})
    assert [c[0] for c in runner.calls].count("llama-cpp-python") == 1
    assert {r.engine for r in report.measured()} == {"edgeinfer"}
    assert any("llama-cpp-python failed" in n and "signal 11" in n for n in report.notes)
    assert "llama-cpp-python failed" in report.text()


def test_edgeinfer_failing_first_raises_its_error(tiny_llama_gguf: Path) -> None:
    runner = Recorded(fail={"edgeinfer": RunFailed("MemoryBudgetError", "plan does not fit")})
    with pytest.raises(Exception, match="plan does not fit") as info:
        run_bench(settings(tiny_llama_gguf), runner=runner, progress=Quiet(), machine={})
    assert type(info.value).__name__ == "MemoryBudgetError"


def test_interrupt_keeps_finished_runs(tiny_llama_gguf: Path) -> None:
    # prompt 8: a warm-up pair and 2 measured pairs; prompt 16: a warm-up pair, then Ctrl-C
    # after edgeinfer's first measured run
    runner = Recorded(stop_after=9)
    report = run_bench(settings(tiny_llama_gguf), runner=runner, progress=Quiet(), machine={})
    assert report.interrupted
    counts = {(r.engine, r.prompt_tokens): len(r.runs) for r in report.measured()}
    assert counts == {("edgeinfer", 8): 2, ("llama-cpp-python", 8): 2, ("edgeinfer", 16): 1}
    data = report.to_dict()
    assert data["interrupted"] is True and len(data["results"]) == 3
    assert "interrupted" in report.text()


def test_peers_for_names_what_is_missing(
    tiny_llama_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    genai = tmp_path / "genai"
    genai.mkdir()
    (genai / "genai_config.json").write_text("{}")
    monkeypatch.setattr("edgeinfer.bench.peers.installed", lambda engine: False)
    peers, skipped = peers_for(tiny_llama_gguf, "gguf", (str(genai),))
    assert peers == []
    assert skipped == [
        "skipping llama-cpp-python: not installed here; add it with pip install "
        "'edgeinfer[gguf]' (llama-cpp-python)",
        "skipping onnxruntime-genai: not installed here; add it with pip install onnxruntime-genai",
    ]
    with pytest.raises(InvalidRequestError, match="not a model a peer runs"):
        peers_for(tiny_llama_gguf, "gguf", (str(tmp_path),))
    _, skipped = peers_for(tmp_path, "onnx")
    assert "--peer-model" in skipped[0]


def test_peer_model_takes_the_place_of_ours_for_its_peer(
    tiny_llama_gguf: Path, tiny_llama_onnx: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    peers, _ = peers_for(tiny_llama_gguf, "gguf", (str(other),))
    assert [(p.engine, p.path) for p in peers] == [("llama-cpp-python", other)]
    peers, _ = peers_for(tiny_llama_onnx, "onnx", (str(other),))
    engines = [p.engine for p in peers]
    assert "llama-cpp-python" in engines and len(engines) == len(set(engines))


def test_a_model_that_is_not_there_fails_before_any_run() -> None:
    with pytest.raises(ModelLoadError):
        run_bench(settings(Path("/no/such.gguf")), runner=Recorded(), progress=Quiet(), machine={})


def test_timings_follow_the_benchmark_protocol() -> None:
    t = timings(10.0, [10.5, 10.6, 10.7, 10.9], n_prompt=100)
    assert t["tokens"] == 4
    assert t["ttft_s"] == pytest.approx(0.5) and t["prefill_tok_s"] == pytest.approx(200)
    assert t["decode_tok_s"] == pytest.approx(3 / 0.4)
    assert timings(0.0, [], 5)["tokens"] == 0


def test_empty_report_says_so() -> None:
    report = BenchReport(settings={}, machine={}, versions={}, created="", command=[])
    assert report.table() == "(nothing measured)\n" and report.to_dict()["results"] == []


def test_saved_result_prints_the_same_table_again(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    report = run_bench(
        settings(tiny_llama_gguf), runner=Recorded(), progress=Quiet(), machine={"arch": "x"}
    )
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps(report.to_dict()))
    again = BenchReport.from_dict(json.loads(saved.read_text()))
    assert again.to_dict() == json.loads(saved.read_text())
    assert again.text(markdown=True) == report.text(markdown=True)
    out = bench("--from", str(saved), "--markdown")
    assert out.returncode == 0 and out.stdout == report.text(markdown=True)
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps({**report.to_dict(), "results": [{"engine": "x"}]}))
    for path, message in ((damaged, "results[0].model is missing"), (tmp_path / "none", "--from")):
        out = bench("--from", str(path))
        assert out.returncode == 1 and message in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.model
def test_default_model_beside_llama_cpp_python(default_gguf: Path) -> None:
    out = bench(
        "smollm2-135m-instruct",
        "-p",
        "32",
        "-n",
        "16",
        "-r",
        "1",
        "--warmup",
        "0",
        "--compare",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    rows = {r["engine"]: r for r in json.loads(out.stdout)["results"]}
    assert {"edgeinfer", "llama-cpp-python"} <= set(rows)
    for row in rows.values():
        assert row["tokens_generated_min"] == 16 and row["tg_tok_s"]["mean"] > 0
        assert row["ratio_to_edgeinfer"]["tg_tok_s"] > 0
    assert rows["edgeinfer"]["peak_rss_mb"]["max"] <= rows["edgeinfer"]["plan_total_mb"]


# -- what the report shows (issue: the bench's output) ----------------------------------------


def test_a_missing_peer_is_said_once(
    tiny_llama_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that is not installed: the line shows once, in the report, not also on the
    progress line."""
    monkeypatch.setattr("edgeinfer.bench.peers.installed", lambda engine: False)
    quiet = Quiet()
    report = run_bench(
        settings(tiny_llama_gguf, repetitions=1, warmup=0, threads=(1,), prompt_tokens=(8,)),
        runner=Recorded(),
        progress=quiet,
        machine={},
    )
    said = "\n".join(quiet.lines) + report.text()
    assert said.count("skipping llama-cpp-python: not installed") == 1, said


def test_one_run_shows_no_spread(tiny_llama_gguf: Path) -> None:
    one = settings(tiny_llama_gguf, repetitions=1, warmup=0, threads=(1,), compare=False)
    text = run_bench(one, runner=Recorded(), progress=Quiet(), machine={}).text()
    assert "±" not in text.split("mean ± stddev")[0], text
    two = settings(tiny_llama_gguf, repetitions=2, warmup=0, threads=(1,), compare=False)
    assert "± 0.0" in run_bench(two, runner=Recorded(), progress=Quiet(), machine={}).text()


def test_the_plot_keeps_its_legend_off_the_bars_and_tells_configurations_apart(
    tiny_llama_gguf: Path,
) -> None:
    pytest.importorskip("matplotlib")
    from edgeinfer.bench.plot import figure, pyplot

    report = run_bench(settings(tiny_llama_gguf), runner=Recorded(), progress=Quiet(), machine={})
    rows = report.measured()
    plt = pyplot()
    fig = figure(plt, rows, 4)
    try:
        fig.canvas.draw()
        top, bottom = fig.axes
        colors = {tuple(bar.get_facecolor()) for bar in top.patches}
        assert len(colors) == 4  # two engines x two thread counts
        for ax in (top, bottom):
            legend = ax.get_legend()
            assert legend is not None
            inside = ax.get_window_extent()
            assert legend.get_window_extent().x0 >= inside.x1  # beside the axes, not on bars
        plan = [c for c in bottom.collections if c.get_label() == "edgeinfer's memory plan"]
        assert not plan or plan[0].get_linewidth()[0] >= 2  # marks wide enough to see
        labels = [t.get_text() for t in bottom.get_xticklabels()]
        assert all(os.path.join(tiny_llama_gguf.parent.name, tiny_llama_gguf.name) in t
                   for t in labels), labels  # fmt: skip
    finally:
        plt.close(fig)
