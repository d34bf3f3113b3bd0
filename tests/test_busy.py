"""busy.py: usable cores (affinity, container quota), others' CPU use, the thread count, and
the hooks that show it (devices, bench) or follow it (llama.cpp between requests)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.config import LoadConfig
from edgeinfer.machine import busy
from edgeinfer.machine.busy import (
    CpuMeter,
    CpuShare,
    ThreadTuner,
    busy_line,
    cgroup_quota_cores,
    cpu_share,
    own_cgroup_quota,
    threads_for,
    usable_cores,
)

# -- recorded files ---------------------------------------------------------------------------

# /proc/self/cgroup and the quota files as a docker container (v1) and a systemd service or
# a v2 container show them.
V1_TABLE = (
    "12:pids:/docker/3f2a\n4:cpu,cpuacct:/docker/3f2a\n3:cpuset:/docker/3f2a\n"
    "1:name=systemd:/docker/3f2a\n0::/\n"
)
V2_TABLE = "0::/system.slice/edge.service\n"


def reader(files: dict[str, str]):  # type: ignore[no-untyped-def]
    return lambda path: files.get(path)


def test_cgroup_v2_quota() -> None:
    assert cgroup_quota_cores("max 100000\n") is None
    assert cgroup_quota_cores("150000 100000\n") == 1.5
    assert cgroup_quota_cores("200000 100000") == 2.0
    assert cgroup_quota_cores("") is None and cgroup_quota_cores("12") is None


def test_cgroup_v1_quota() -> None:
    assert cgroup_quota_cores(quota="-1\n", period="100000\n") is None
    assert cgroup_quota_cores(quota="50000\n", period="100000\n") == 0.5
    assert cgroup_quota_cores(quota="50000", period="0") is None
    assert cgroup_quota_cores(quota=None, period="100000") is None


def test_own_quota_from_recorded_files() -> None:
    v1 = {
        "/proc/self/cgroup": V1_TABLE,
        "/sys/fs/cgroup/cpu,cpuacct/docker/3f2a/cpu.cfs_quota_us": "150000\n",
        "/sys/fs/cgroup/cpu,cpuacct/docker/3f2a/cpu.cfs_period_us": "100000\n",
    }
    assert own_cgroup_quota(reader(v1)) == 1.5
    v2 = {
        "/proc/self/cgroup": V2_TABLE,
        "/sys/fs/cgroup/system.slice/edge.service/cpu.max": "300000 100000\n",
    }
    assert own_cgroup_quota(reader(v2)) == 3.0
    # v2 root: no quota; files missing: none either
    root = {"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/cpu.max": "max 100000"}
    assert own_cgroup_quota(reader(root)) is None
    assert own_cgroup_quota(reader({})) is None
    assert own_cgroup_quota(reader({"/proc/self/cgroup": V1_TABLE})) is None


def test_usable_cores_takes_the_smallest() -> None:
    assert usable_cores(8, 16, None) == 8  # hyper-threads do not count
    assert usable_cores(8, 4, None) == 4  # taskset / cpuset
    assert usable_cores(8, 16, 1.5) == 2  # a quota of 1.5 CPUs: two threads, half the time
    assert usable_cores(8, 16, 0.5) == 1
    assert usable_cores(None, None, None) == 1
    assert usable_cores(None, 3, None) == 3


def test_threads_leave_busy_cores_to_others() -> None:
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.3) == 2  # a little background work keeps both
    assert threads_for(2, 0.5) == 1  # one core half taken: waiting at barriers costs more
    assert threads_for(2, 1.0) == 1
    assert threads_for(2, 2.0) == 1  # never fewer than one
    assert threads_for(8, 1.2) == 7
    assert threads_for(8, 2.6) == 5


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 512), st.floats(0, 1e9, allow_nan=False))
def test_threads_are_between_one_and_usable(usable: int, others: float) -> None:
    assert 1 <= threads_for(usable, others) <= usable


files_text = st.text(max_size=80) | st.sampled_from(
    ["-1", "max", "0 0", "1" * 400, "--1", "9" * 15]
)


@settings(max_examples=300, deadline=None)
@given(files_text, files_text, files_text)
def test_hostile_cgroup_files_never_raise(a: str, b: str, c: str) -> None:
    """The kernel writes these files, but a container runtime or a test can put anything
    there: every reading is None or a positive finite number of CPUs, and the usable cores
    stay an integer >= 1."""
    for quota in (cgroup_quota_cores(a), cgroup_quota_cores(quota=b, period=c)):
        assert quota is None or 0 < quota < float("inf")
        assert usable_cores(4, 4, quota) >= 1
    files = {
        "/proc/self/cgroup": a,
        "/sys/fs/cgroup" + a.partition("::")[2].strip().rstrip("/") + "/cpu.max": b,
    }
    found = own_cgroup_quota(reader(files))
    assert found is None or 0 < found < float("inf")


# -- measuring others' use --------------------------------------------------------------------


class FakeCounters:
    """The kernel's counters, moved by hand: wall time, all CPUs' busy time, ours."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.wall = 100.0
        self.busy = 0.0
        self.own = 0.0
        monkeypatch.setattr(busy.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(busy, "_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(busy, "_own_seconds", lambda process: self.own)

    def spend(self, wall: float, others: float, ours: float) -> None:
        self.wall += wall
        self.busy += (others + ours) * wall
        self.own += ours * wall


def test_our_own_threads_are_not_someone_elses_load(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = FakeCounters(monkeypatch)
    meter = CpuMeter()
    usable = meter.usable
    counters.spend(2.0, others=0.0, ours=float(usable))  # we decode on every core
    share = meter.share()
    assert share.busy == pytest.approx(0.0) and share.threads == usable
    counters.spend(1.0, others=1.0, ours=max(0.0, usable - 1.0))  # a hog on one core
    share = meter.share()
    assert share.busy == pytest.approx(1.0) and share.threads == max(1, usable - 1)


def test_tuner_waits_for_a_window_then_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = FakeCounters(monkeypatch)
    monkeypatch.setattr(busy, "usable_cores", lambda *a: 2)
    tuner = ThreadTuner(2, recheck_s=1.0)
    counters.spend(0.5, others=1.0, ours=1.0)
    assert tuner.check() is None  # too short a window to judge
    counters.spend(0.6, others=1.0, ours=1.0)
    assert tuner.check() == 1 and tuner.threads == 1
    counters.spend(2.0, others=1.0, ours=1.0)
    assert tuner.check() is None  # unchanged
    counters.spend(2.0, others=0.0, ours=1.0)  # the hog ended
    assert tuner.check() == 2


def test_config_samples_once_and_never_with_explicit_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def fake_share(window_s: float = 0.1) -> CpuShare:
        calls.append(1)
        return CpuShare(usable=4, busy=1.0, threads=3, window_s=window_s)

    monkeypatch.setattr("edgeinfer.config.cpu_share", fake_share)
    config = LoadConfig()
    assert config.resolved_threads == 3 and config.resolved_threads == 3
    again = dataclasses.replace(config, parallel=2)
    assert again.resolved_threads == 3 and len(calls) == 1
    assert "1.0 of 4 usable cores busy" in again.threads_why
    explicit = LoadConfig(threads=2)
    assert explicit.resolved_threads == 2 and len(calls) == 1
    assert explicit.threads_why == "threads=2 was asked for"


def test_busy_line_says_busy_only_when_threads_were_cut() -> None:
    idle = busy_line(CpuShare(2, 0.1, 2, 0.1), (0.5, 0.4, 0.3))
    assert idle.startswith("load average 0.50 0.40 0.30") and "BUSY" not in idle
    loaded = busy_line(CpuShare(2, 1.0, 1, 0.1), (3.0, 2.0, 1.0))
    assert "BUSY" in loaded and "1 compute thread " in loaded


# -- where it shows -----------------------------------------------------------------------------


def _hog() -> subprocess.Popen[bytes]:
    """A busy loop in a child process, returned once it is spinning."""
    spin = "import sys\nsys.stdout.write('x')\nsys.stdout.flush()\nwhile 1: pass"
    hog = subprocess.Popen(
        [sys.executable, "-c", spin],
        stdout=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert hog.stdout is not None and hog.stdout.read(1) == b"x"
    return hog


def _needs_two_cores() -> int:
    usable = CpuMeter().usable
    if usable < 2:
        pytest.skip("one usable core: one thread with or without a busy loop, no drop to show")
    return usable


def test_the_thread_count_drops_beside_a_busy_loop() -> None:
    """The live meter, in the same test: a window that leaves room for two threads or more,
    then a window with our busy loop spinning chooses fewer (the loop keeps a core taken)."""
    usable = _needs_two_cores()
    for _ in range(20):  # others' work comes and goes: wait for a window with room to drop
        before = cpu_share(0.25)
        if before.threads >= 2:
            break
    else:
        pytest.skip(
            f"other processes kept {before.busy:.1f} of {usable} cores busy in every window: "
            "one thread already, no drop can show"
        )
    hog = _hog()
    try:
        beside = cpu_share(0.25)
    finally:
        hog.kill()
        hog.wait()
    assert beside.busy >= 0.5, (before, beside)  # the loop counts as someone else's work
    assert beside.threads <= usable - 1 and beside.threads < before.threads, (before, beside)


def test_devices_says_how_busy_the_machine_is_beside_a_hog() -> None:
    """The real CLI, with a busy loop of ours running: one 'cpu load' line, exit 0, and
    the JSON form carries the same record."""
    hog = _hog()
    try:
        cmd = [sys.executable, "-m", "edgeinfer", "devices"]
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        as_json = subprocess.run(
            [*cmd, "--json"], capture_output=True, text=True, timeout=120, check=False
        )
    finally:
        hog.kill()
        hog.wait()
    assert text.returncode == 0, text.stderr
    lines = [x for x in text.stdout.splitlines() if x.startswith("cpu load")]
    assert len(lines) == 1 and "load average" in lines[0]
    record = json.loads(as_json.stdout)["busy"]
    usable = record["usable_cores"]
    assert usable >= 1 and 1 <= record["threads"] <= usable
    if usable >= 2:  # the loop keeps a core busy all through the window: one thread fewer
        assert record["busy_cores"] >= 0.5 and record["threads"] <= usable - 1, record
        assert "BUSY" in record["line"] and "BUSY" in lines[0]
    assert record["line"].startswith("load average")


def test_recorded_machine_has_no_busy_line(tmp_path: Path) -> None:
    record = tmp_path / "m.json"
    subprocess.run([sys.executable, "-m", "edgeinfer", "devices", "--record", str(record)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "devices", "--inventory", str(record)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "cpu load" not in done.stdout


# -- llama.cpp follows it between requests ------------------------------------------------------


class OneThreadTuner:
    threads = 2
    last = CpuShare(2, 1.0, 1, 1.0)

    def check(self) -> int | None:
        return 1


@pytest.mark.model
def test_llama_cpp_sets_threads_between_requests(default_gguf: Path) -> None:
    import edgeinfer

    with edgeinfer.load(default_gguf, context_length=256) as model:
        backend = model._backend
        assert backend._tuner is not None  # threads=None: re-measured
        reference = model.generate("Hello", max_new_tokens=4, temperature=0).token_ids
        backend._tuner = OneThreadTuner()
        again = model.generate("Hello", max_new_tokens=4, temperature=0).token_ids
        assert backend._llama.llama_n_threads(backend._ctx) == 1
        assert model.info["threads"] == 1 and "1.0 of 2 usable" in model.info["threads_why"]
        assert again == reference  # the thread count changes the speed, not the tokens
    with edgeinfer.load(default_gguf, context_length=256, threads=2) as model:
        assert model._backend._tuner is None
        assert model.info["threads_why"] == "threads=2 was asked for"
