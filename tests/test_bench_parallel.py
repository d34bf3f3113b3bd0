"""``edgeinfer bench --parallel``: many streams at once. The figures from stamps (exact
arithmetic on made-up stamps, no clock), the runner's parallel axis with a recorded runner,
onnxruntime-genai's Engine driven through a stand-in, the checks of --parallel values and of
saved parallel rows, and the real command on a tiny model."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgeinfer.bench import BenchSettings, run_bench
from edgeinfer.bench.records import BenchResultError, check_report, check_run
from edgeinfer.bench.report import BenchReport, done_tok_s
from edgeinfer.bench.runner import ProgressLine
from edgeinfer.bench.streams import _EngineDriver, parallel_figures, percentile
from edgeinfer.cli.bench import int_list
from edgeinfer.errors import InvalidRequestError

CLI = [sys.executable, "-m", "edgeinfer.cli", "bench"]
TINY = ["-p", "8", "-n", "4", "-r", "1", "--warmup", "0", "--context-length", "64"]


# -- figures from stamps ----------------------------------------------------------------------


def test_one_stream_gives_the_single_stream_figures() -> None:
    got = parallel_figures([10.0], [[10.5, 10.6, 10.7, 10.9]], n_prompt=50)
    assert got["parallel"] == 1 and got["tokens"] == 4
    assert got["ttft_s"] == pytest.approx(0.5) == got["ttft_p50_s"] == got["ttft_p95_s"]
    assert got["prefill_tok_s"] == pytest.approx(100.0)
    assert got["decode_tok_s"] == pytest.approx(3 / 0.4)  # (n - 1) / (last - first)
    assert got["steady_decode_tok_s"] == pytest.approx(got["decode_tok_s"])
    assert got["per_stream_decode_tok_s"] == pytest.approx(got["decode_tok_s"])


def test_streams_together_aggregate_their_tokens() -> None:
    # two streams start at 0; the second's prefill ends later (it waited for the first's)
    a = [1.0, 2.0, 3.0, 4.0, 5.0]
    b = [2.0, 3.0, 4.0, 5.0, 6.0]
    got = parallel_figures([0.0, 0.0], [a, b], n_prompt=10)
    assert got["tokens"] == 10
    assert got["decode_tok_s"] == pytest.approx(8 / 5.0)  # 4 + 4 decode tokens, 1.0 -> 6.0
    # both decoding from 2.0 to 5.0: 3 steps each
    assert got["steady_decode_tok_s"] == pytest.approx(6 / 3.0)
    assert got["per_stream_decode_tok_s"] == pytest.approx(1.0)
    assert got["ttft_p50_s"] == pytest.approx(1.5) and got["ttft_p95_s"] == pytest.approx(1.95)
    assert got["prefill_tok_s"] == pytest.approx(20 / 2.0)
    assert [s["ttft_s"] for s in got["streams"]] == [1.0, 2.0]


def test_start_to_end_counts_every_token_over_the_time_to_the_last() -> None:
    """Two orders of the same work: streams interleaved (first tokens early, decode spread)
    and prefills first (every first token late, then decode) give the same figure when the
    last token comes at the same time; the decode-span figure favours the second."""
    interleaved = parallel_figures([0.0, 0.0], [[1.0, 3.0, 5.0, 7.0], [2.0, 4.0, 6.0, 8.0]], 4)
    prefills_first = parallel_figures([0.0, 0.0], [[5.0, 6.0, 7.0, 8.0], [5.0, 6.0, 7.0, 8.0]], 4)
    assert done_tok_s(interleaved) == pytest.approx(8 / 8.0) == done_tok_s(prefills_first)
    assert interleaved["decode_tok_s"] < prefills_first["decode_tok_s"]
    assert done_tok_s(parallel_figures([0.0, 0.0], [[], []], n_prompt=4)) == 0.0


@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "tokens": st.integers(0, 10**6),
                "ttft_s": st.floats(0, 1e6, allow_nan=False),
                "decode_tok_s": st.floats(0, 1e6, allow_nan=False, allow_subnormal=True),
            }
        ),
        max_size=16,
    )
)
def test_start_to_end_of_any_checked_streams_is_a_finite_rate(streams: list[dict]) -> None:
    """What ``--from`` files may hold (every figure finite and >= 0) gives a finite rate."""
    got = done_tok_s({"streams": streams})
    assert math.isfinite(got) and got >= 0


def test_a_stream_without_tokens_counts_zero() -> None:
    got = parallel_figures([0.0, 0.0], [[], []], n_prompt=4)
    assert got["tokens"] == 0 and got["decode_tok_s"] == 0.0 and len(got["streams"]) == 2
    check_run({**got, "peak_rss_bytes": 1.0, "join_ttft_s": 0.0}, parallel=2)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50), st.floats(0, 1))
def test_percentile_lies_between_the_extremes(values: list[float], q: float) -> None:
    got = percentile(values, q)
    assert min(values) <= got <= max(values)
    assert percentile(values, 0) == min(values) and percentile(values, 1) == max(values)


stamp_lists = st.lists(
    st.lists(st.floats(0.001, 1e4, allow_nan=False), max_size=20).map(sorted),
    min_size=1,
    max_size=8,
)


@given(stamp_lists)
@example([[0.001, 0.0010000000000000002]])  # a span below the clock's step: no rate of 4.6e18
def test_figures_of_any_stamps_pass_the_run_check(stamps: list[list[float]]) -> None:
    got = parallel_figures([0.0] * len(stamps), stamps, n_prompt=16)
    record = {**got, "peak_rss_bytes": 1e8, "join_ttft_s": 0.1}
    assert check_run(json.loads(json.dumps(record)), parallel=len(stamps))
    live = [s for s in stamps if s]
    if live:  # all decoding is a part of the whole: never more tokens, never a longer span
        assert got["ttft_p50_s"] <= got["ttft_p95_s"]


# -- the runner's parallel axis ---------------------------------------------------------------


class Recorded:
    """Stands in for the fresh process of each run: records its spec, answers with figures."""

    def __init__(self) -> None:
        self.specs: list[dict[str, Any]] = []

    def __call__(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.specs.append(spec)
        n = spec["parallel"]
        stamps = [[0.1 + i / 100 + k / 50 for k in range(spec["new_tokens"])] for i in range(n)]
        fast = 2.0 if spec["engine"] == "edgeinfer" else 1.0
        stamps = [[t / fast for t in s] for s in stamps]
        return {
            **parallel_figures([0.0] * n, stamps, spec["prompt_tokens"]),
            "join_ttft_s": 0.1 * (1 + n / 8),
            "peak_rss_bytes": 2e8,
            "provider": "x",
            "device": "cpu",
            "context_length": spec["context_length"],
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


def genai_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "genai"
    folder.mkdir()
    (folder / "genai_config.json").write_text("{}")
    return folder


def test_every_stream_count_is_a_row(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_genai")
    runner, quiet = Recorded(), Quiet()
    s = BenchSettings(
        models=(str(tiny_llama_gguf),), prompt_tokens=(8,), new_tokens=4, repetitions=2,
        warmup=1, threads=(1,), compare=True, peer_models=(str(genai_folder(tmp_path)),),
        parallel=(1, 2, 4),
    )  # fmt: skip
    report = run_bench(s, runner=runner, progress=quiet, machine={})
    # llama-cpp-python runs one sequence at a time: left out, said once
    assert [e for e in report.notes if "llama-cpp-python" in e] == [
        "skipping llama-cpp-python at --parallel: it runs one sequence at a time"
    ]
    engines = [(x["engine"], x["parallel"]) for x in runner.specs]
    assert engines == [(e, n) for n in (1, 2, 4) for _ in range(3)
                       for e in ("edgeinfer", "onnxruntime-genai")]  # fmt: skip
    rows = {(r.engine, r.parallel): r for r in report.measured()}
    assert set(rows) == {(e, n) for e in ("edgeinfer", "onnxruntime-genai") for n in (1, 2, 4)}
    data = report.to_dict()
    for row in data["results"]:
        assert row["repetitions"] == 2 and row["parallel"] in (1, 2, 4)
        assert row["tg_tok_s"]["mean"] > 0 and row["stream_tg_tok_s"]["mean"] > 0
        assert row["ttft_pooled_ms"]["p50"] <= row["ttft_pooled_ms"]["p95"]
        one = rows[(row["engine"], 1)].figure("tg_tok_s")["mean"]
        assert row["ratio_to_one_stream"]["tg_tok_s"] == pytest.approx(
            row["tg_tok_s"]["mean"] / one
        )
    peer = next(r for r in data["results"] if r["engine"] != "edgeinfer")
    assert peer["ratio_to_edgeinfer"]["tg_tok_s"] == pytest.approx(0.5)
    text = report.text()
    assert "tg t/s per stream" in text and "join TTFT vs alone" in text
    assert "x4" in " ".join(quiet.lines)
    # the saved report reads back to the same report
    saved = json.loads(json.dumps(data))
    again = BenchReport.from_dict(saved)
    assert again.to_dict() == saved and again.text() == text


def test_without_parallel_the_classic_rows_stay(tiny_llama_gguf: Path) -> None:
    seen: list[dict[str, Any]] = []

    def runner(spec: dict[str, Any]) -> dict[str, Any]:
        seen.append(spec)
        return {"tokens": 4, "ttft_s": 0.1, "prefill_tok_s": 80.0, "decode_tok_s": 50.0,
                "peak_rss_bytes": 1e8, "prompt_ids": [1], "ban_ids": [0]}  # fmt: skip

    s = BenchSettings(models=(str(tiny_llama_gguf),), prompt_tokens=(8,), new_tokens=4,
                      repetitions=1, warmup=0, threads=(1,))  # fmt: skip
    report = run_bench(s, runner=runner, progress=Quiet(), machine={})
    assert "parallel" not in seen[0]
    assert "parallel" not in report.to_dict()["results"][0]
    assert "tg t/s per stream" not in report.text()


# -- hostile --parallel values ----------------------------------------------------------------


@pytest.mark.parametrize(
    "value, says",
    [
        ("", "--parallel '' is invalid"),
        ("0", "--parallel 0 is invalid"),
        ("-1", "--parallel -1 is invalid"),
        ("1,,2", "--parallel '1,,2' is invalid"),
        ("two", "--parallel 'two' is invalid"),
        ("1.5", "--parallel '1.5' is invalid"),
        ("257", "--parallel 257 is invalid: at most 256"),
        ("9" * 40, "at most 256"),
        ("2,2", "twice"),
        ("auto", "--parallel 'auto' is invalid"),
    ],
)
def test_bad_parallel_values_are_one_line_errors(value: str, says: str) -> None:
    out = subprocess.run([*CLI, "some-model", "--parallel", value], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1 and out.stdout == "", out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def checked_parallel(text: str) -> tuple[int, ...]:
    values = int_list("--parallel", text)
    return BenchSettings(models=("m",), parallel=values).checked().parallel


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_any_parallel_text_is_a_list_of_counts_or_one_error(text: str) -> None:
    try:
        got = checked_parallel(text)
    except InvalidRequestError as exc:
        assert str(exc).startswith("--parallel") and "\n" not in str(exc)
        return
    assert got and all(1 <= n <= 256 for n in got) and len(set(got)) == len(got)


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=12).filter(lambda t: not t.startswith("-")))  # fmt: skip
def test_hostile_parallel_through_the_real_command(value: str) -> None:
    out = subprocess.run([*CLI, "no-such-model-x", "--parallel", value], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert "Traceback" not in out.stderr and out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


# -- saved parallel rows ----------------------------------------------------------------------


def parallel_report() -> dict[str, Any]:
    report = BenchReport(
        settings={"repetitions": 1, "warmup": 0, "new_tokens": 4, "context_length": 64,
                  "parallel": [1, 2]},
        machine={}, versions={"edgeinfer": "0"}, created="2025-01-01", command=["edgeinfer"],
    )  # fmt: skip
    for n in (1, 2):
        row = report.row("m", "/m", "edgeinfer", "/m", 1, 8, 4, parallel=n)
        stamps = [[0.1 + k / 10 for k in range(4)] for _ in range(n)]
        row.runs.append({**parallel_figures([0.0] * n, stamps, 8), "join_ttft_s": 0.1,
                         "peak_rss_bytes": 1e8})  # fmt: skip
    return report.to_dict()


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda r: r["results"][1]["runs"][0].pop("streams"), "streams is missing"),
        (lambda r: r["results"][1]["runs"][0].update(parallel=3), "parallel must be the run's 2"),
        (lambda r: r["results"][1].update(parallel=0), "results[1].parallel must be"),
        (lambda r: r["results"][1]["runs"][0]["streams"][0].update(ttft_s=-1), "streams must be"),
        (lambda r: r["results"][0]["runs"][0].update(join_ttft_s=None), "join_ttft_s must be"),
        (lambda r: r["settings"].update(parallel=[0]), "settings.parallel must be"),
        (lambda r: r["results"][1]["runs"][0].update(streams=[{}] * 300), "streams must be"),
    ],
)
def test_a_damaged_parallel_row_is_named(damage: Any, says: str) -> None:
    data = parallel_report()
    check_report(copy.deepcopy(data), "r.json")
    damage(data)
    with pytest.raises(BenchResultError, match=r"r\.json") as info:
        BenchReport.from_dict(data, what="r.json")
    assert says in str(info.value)


# -- onnxruntime-genai's Engine, through a stand-in ------------------------------------------


class FakeOg:
    """The parts of onnxruntime_genai the driver uses, with the behaviour seen on the CPU:
    static batching (a request arriving while a batch runs waits for it to end)."""

    class EngineEventFlags:
        TOKEN, TURN_FINISHED, FAILED = 1, 2, 8

    class TurnOptions:
        def __init__(self, request: Any) -> None:
            self.request = request

        def set_do_sample(self, value: bool) -> None:
            assert value is False

        def set_max_generated_tokens(self, n: int) -> None:
            self.request.left = n

        def set_min_generated_tokens(self, n: int) -> None:
            assert n == self.request.left


class FakeEvent:
    def __init__(self, request: Any, flags: int) -> None:
        self.request, self.flags, self.error_code = request, flags, 0


class FakeRequest:
    def __init__(self) -> None:
        self.left = 0
        self.closed = False

    def begin_turn(self, ids: Any, turn: Any) -> None:
        assert len(ids) > 0

    def close(self) -> None:
        self.closed = True


class FakeEngine:
    def __init__(self) -> None:
        self.waiting: list[FakeRequest] = []
        self.batch: list[FakeRequest] = []
        self.requests: list[FakeRequest] = []

    def create_event_buffer(self, n: int) -> None:
        return None

    def create_request(self) -> FakeRequest:
        request = FakeRequest()
        self.waiting.append(request)
        self.requests.append(request)
        return request

    def run(self, buffer: Any) -> list[FakeEvent]:
        if not self.batch:  # static batching: a new batch only when the last one is done
            self.batch, self.waiting = self.waiting, []
        events = []
        for r in self.batch:
            r.left -= 1
            done = r.left == 0 or r.closed
            events.append(FakeEvent(r, 1 | (2 if done else 0)))
        self.batch = [r for r in self.batch if r.left > 0 and not r.closed]
        return events


def test_the_engine_driver_stamps_each_request() -> None:
    engine = FakeEngine()
    driver = _EngineDriver(FakeOg, engine, new_tokens=5)
    starts, stamps = driver.together([[1, 2, 3]] * 3)
    assert len(starts) == 3 and [len(s) for s in stamps] == [5, 5, 5]
    ttft = driver.joining([[1, 2, 3]] * 4)
    assert ttft > 0
    # the joiner waited for the running batch: it got its token after theirs ended
    assert all(r.closed for r in engine.requests)


# -- the real command -------------------------------------------------------------------------


def test_parallel_streams_on_a_tiny_model(tiny_llama_gguf: Path) -> None:
    out = subprocess.run([*CLI, str(tiny_llama_gguf), *TINY, "--threads", "1",
                          "--parallel", "1,2", "--json"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["settings"]["parallel"] == [1, 2]
    rows = {r["parallel"]: r for r in report["results"]}
    assert set(rows) == {1, 2}
    for n, row in rows.items():
        assert row["engine"] == "edgeinfer" and row["tokens_generated_min"] == 4 * n
        for name in ("tg_tok_s", "stream_tg_tok_s", "ttft_p50_ms",
                     "ttft_p95_ms", "join_ttft_ms", "peak_rss_mb"):  # fmt: skip
            assert row[name]["min"] > 0, name
        # the steady span (every stream decoding) can be empty when 4 tokens of one stream
        # end before the other's first token on a busy machine; one stream always has one
        assert row["steady_tg_tok_s"]["min"] > 0 if n == 1 else row["steady_tg_tok_s"]["min"] >= 0
        (run,) = row["runs"]
        assert run["parallel"] == n and len(run["streams"]) == n
        assert all(s["tokens"] == 4 for s in run["streams"])
    assert rows[1]["ratio_to_one_stream"]["tg_tok_s"] == pytest.approx(1.0)
    table = subprocess.run([*CLI, str(tiny_llama_gguf), *TINY, "--parallel", "2"],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert "TTFT p95 ms" in table.stdout and "tg t/s per stream" in table.stdout


# -- what edgeinfer's run loads ---------------------------------------------------------------


def test_a_catalog_name_is_loaded_by_its_name(tmp_path: Path) -> None:
    from edgeinfer.bench.peers import as_named
    from edgeinfer.files import catalog

    path = tmp_path / "m.gguf"
    assert as_named(catalog.DEFAULT_MODEL, path) == catalog.DEFAULT_MODEL  # routed by name
    assert as_named(str(path), path) == str(path)
    assert as_named("not-in-the-catalog", path) == str(path)


def test_engine_reaches_the_runs(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_genai")
    runner = Recorded()
    s = BenchSettings(models=(str(tiny_llama_gguf),), prompt_tokens=(8,), new_tokens=4,
                      repetitions=1, warmup=0, threads=(1,), parallel=(2,), compare=True,
                      peer_models=(str(genai_folder(tmp_path)),), engine="llama.cpp")  # fmt: skip
    run_bench(s, runner=runner, progress=Quiet(), machine={})
    assert [x.get("route") for x in runner.specs] == ["llama.cpp", "llama.cpp"]
    with pytest.raises(InvalidRequestError, match="--engine 'vulkan' is invalid"):
        BenchSettings(models=("m",), engine="vulkan").checked()
