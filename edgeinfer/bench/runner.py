"""Runs a benchmark: every configuration, every engine, one fresh process per run, engines
interleaved round by round so the machine's noise falls on all of them alike."""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from itertools import product
from typing import Any, TextIO

from ..config import MAX_THREADS, LoadConfig
from ..errors import (
    BackendUnavailableError,
    ConversionError,
    EdgeInferError,
    InvalidRequestError,
    MemoryBudgetError,
    ModelLoadError,
)
from ..generation.speculative import parse_speculative
from .peers import Peer, as_named, peers_for
from .records import (
    MAX_PARALLEL,
    MAX_RESULT_LINE_BYTES,
    BenchResultError,
    check_error,
    check_run,
    one_line,
    parse_result_line,
)
from .report import BenchReport
from .worker import PARALLEL_ENGINES, RESULT_MARK

__all__ = ["BenchSettings", "run_bench"]

_ERRORS: dict[str, type[EdgeInferError]] = {
    cls.__name__: cls
    for cls in (
        ModelLoadError,
        BackendUnavailableError,
        MemoryBudgetError,
        ConversionError,
        InvalidRequestError,
        BenchResultError,
    )
}
DEFAULT_RUN_TIMEOUT_S = 600.0  # one run (one process): a big model on a board, pp512+tg128
# the worker's command; a test may stand a fake in its place
WORKER = (sys.executable, "-m", "edgeinfer.bench.worker")
_TAIL_BYTES = MAX_RESULT_LINE_BYTES + 2**16  # of a run's stdout: where its result line is
_VERSIONED = (
    "edgeinfer",
    "llama-cpp-python",
    "onnxruntime",
    "onnxruntime-genai",
    "optimum",
    "transformers",
    "torch",
    "numpy",
)


@dataclass(frozen=True)
class BenchSettings:
    models: tuple[str, ...]
    prompt_tokens: tuple[int, ...] = (128, 512)
    new_tokens: int = 128
    repetitions: int = 5
    warmup: int = 1
    threads: tuple[int, ...] = ()  # () = the physical cores, as load() uses
    device: str = "auto"
    memory_budget: str | None = None
    context_length: int | None = None  # None: room for the longest prompt and the reply
    compare: bool = False
    peer_models: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_RUN_TIMEOUT_S  # per run; a peer that takes longer is left out
    parallel: tuple[int, ...] = ()  # streams at once (--parallel); () = the one-stream run
    engine: str = "auto"  # what runs a GGUF for edgeinfer: load()'s engine= (--engine)
    speculative: str = "off"  # edgeinfer's speculative decoding: load()'s (--speculative)

    def checked(self) -> BenchSettings:
        """These settings with defaults filled in; InvalidRequestError names a bad one."""
        if not self.models:
            raise InvalidRequestError("name at least one MODEL to benchmark")
        _positive_list("-p/--prompt-tokens", self.prompt_tokens)
        if (
            isinstance(self.new_tokens, bool)
            or not isinstance(self.new_tokens, int)
            or (self.new_tokens < 2)
        ):
            raise InvalidRequestError(
                f"-n/--new-tokens {self.new_tokens!r} is invalid: at least 2 tokens are needed "
                "to time generation"
            )
        _positive("-r/--repetitions", self.repetitions)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise InvalidRequestError(f"--warmup {self.warmup!r} is invalid: expected 0 or more")
        threads = _threads(self.threads)
        parse_speculative(self.speculative)  # InvalidRequestError names a bad setting
        context = self._context_length()
        if self.peer_models and not self.compare:
            raise InvalidRequestError("--peer-model names a peer's model: add --compare")
        return replace(
            self,
            models=tuple(self.models),
            prompt_tokens=tuple(self.prompt_tokens),
            threads=threads,
            context_length=context,
            peer_models=tuple(self.peer_models),
            timeout_s=_timeout(self.timeout_s),
            parallel=_parallel_axis(self.parallel),
            engine=_engine(self.engine),
        )

    def _context_length(self) -> int:
        """The context asked for, or room for the longest prompt and the reply."""
        need = max(self.prompt_tokens) + self.new_tokens
        context = self.context_length
        if context is None:
            return max(1024, math.ceil(need / 256) * 256)
        if isinstance(context, bool) or not isinstance(context, int) or context < need:
            raise InvalidRequestError(
                f"--context-length {context!r} is too small: the longest prompt and the reply "
                f"need {need} tokens"
            )
        return context


def _threads(threads: tuple[int, ...]) -> tuple[int, ...]:
    """The thread counts asked for, or the physical cores (as load() uses)."""
    threads = threads or (LoadConfig().resolved_threads,)
    _positive_list("--threads", threads)
    if max(threads) > MAX_THREADS:
        raise InvalidRequestError(f"--threads {max(threads)} is invalid: at most {MAX_THREADS}")
    return tuple(threads)


def _parallel_axis(values: tuple[int, ...]) -> tuple[int, ...]:
    """The stream counts asked for (--parallel), each once, from 1 to MAX_PARALLEL."""
    values = tuple(values)
    if not values:
        return ()
    _positive_list("--parallel", values)
    if max(values) > MAX_PARALLEL:
        raise InvalidRequestError(
            f"--parallel {max(values)} is invalid: at most {MAX_PARALLEL} streams at once"
        )
    if len(set(values)) != len(values):
        raise InvalidRequestError(f"--parallel names {values} twice: give each count once")
    return values


def _engine(engine: object) -> str:
    if engine not in ("auto", "llama.cpp", "onnxruntime"):
        raise InvalidRequestError(
            f"--engine {engine!r} is invalid: expected auto, llama.cpp or onnxruntime"
        )
    return str(engine)


def _timeout(timeout: object) -> float:
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (0 < timeout < math.inf)
    ):
        raise InvalidRequestError(
            f"--timeout {timeout!r} is invalid: expected a number of seconds > 0"
        )
    return float(timeout)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"{name} {value!r} is invalid: expected a whole number >= 1")


def _positive_list(name: str, values: tuple[int, ...]) -> None:
    if not values:
        raise InvalidRequestError(f"{name} is empty: give at least one value, e.g. 128,512")
    for v in values:
        _positive(name, v)


def versions() -> dict[str, str]:
    found = {}
    for name in _VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    found["python"] = sys.version.split()[0]
    return found


class ProgressLine:
    """Which configuration, engine and run is going on, on stderr: one line rewritten on a
    terminal, one line per run otherwise."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._width = 0

    def show(self, text: str) -> None:
        if self._tty:
            self._stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def say(self, text: str) -> None:
        """A message that stays (a peer skipped or failed)."""
        self.clear()
        self._stream.write(text + "\n")
        self._stream.flush()

    def clear(self) -> None:
        if self._tty and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0


class RunFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


Runner = Callable[[dict[str, Any]], dict[str, Any]]


def run_in_fresh_process(spec: dict[str, Any], worker: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run in a new interpreter, in its own process group; RunFailed when the engine
    fails, the process dies, its result line is damaged, or it runs past ``spec["timeout_s"]``
    (then it is killed with every process it started)."""
    timeout = spec.get("timeout_s")
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, \
            tempfile.TemporaryFile() as err:  # fmt: skip
        # files, not pipes: nothing blocks on a run that stops reading or floods its output
        stdin.write(json.dumps(spec).encode("utf-8"))
        stdin.seek(0)
        proc = subprocess.Popen(
            list(worker or WORKER), stdin=stdin, stdout=out, stderr=err, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RunFailed(
                "timeout", f"the run took longer than {timeout:g} s (--timeout) and was stopped"
            ) from None
        finally:  # Ctrl-C or a timeout: the run is abandoned; always: nothing left behind
            _kill_group(proc)
        return _result(spec, proc.returncode, _tail(out, _TAIL_BYTES), err)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the run and anything it started (its process group), and reap it."""
    killpg = getattr(os, "killpg", None)
    try:
        if killpg is not None:
            killpg(proc.pid, signal.SIGKILL)
        elif proc.poll() is None:
            proc.kill()
    except OSError:  # nothing left in the group
        pass
    proc.wait()


def _tail(file: Any, size: int) -> bytes:
    file.seek(0, os.SEEK_END)
    end = file.tell()
    file.seek(max(0, end - size))
    data = file.read()
    return data if end <= size else data.partition(b"\n")[2]  # from the first whole line


def _result(spec: dict[str, Any], returncode: int, out: bytes, err: Any) -> dict[str, Any]:
    mark = RESULT_MARK.encode("utf-8")
    for line in reversed(out.split(b"\n")):
        if not line.startswith(mark):
            continue
        try:
            record = parse_result_line(line[len(mark) :], "its result line")
        except BenchResultError as exc:
            raise RunFailed("BenchResultError", str(exc)) from None
        try:
            if "error" in record:
                raise RunFailed(*check_error(record))
            return check_run(
                record, needs_ids=spec.get("engine") == "edgeinfer", parallel=spec.get("parallel")
            )
        except BenchResultError as exc:
            raise RunFailed("BenchResultError", f"its result line is damaged: {exc}") from None
    tail = one_line(" | ".join(_tail(err, 4096).decode("utf-8", "replace").splitlines()[-3:]))
    how = (
        f"was killed by signal {-returncode}"
        if returncode < 0
        else (f"exited with status {returncode}")
    )
    raise RunFailed("crash", f"the process {how} without a result{': ' + tail if tail else ''}")


@dataclass(frozen=True)
class _Bench:
    """What every run of one benchmark shares; the report fills as runs finish."""

    settings: BenchSettings  # checked: defaults filled in
    progress: ProgressLine
    runner: Runner
    report: BenchReport
    rounds: int  # warm-up and measured rounds of each configuration

    @property
    def per_model(self) -> int:
        s = self.settings
        return len(s.threads) * len(s.prompt_tokens) * len(s.parallel or (0,)) * self.rounds

    @property
    def total(self) -> int:
        return len(self.settings.models) * self.per_model


@dataclass(frozen=True)
class _Run:
    """One round of one configuration; edgeinfer runs it first, then each peer."""

    source: Any  # the model, resolved (name, path, format)
    threads: int
    prompt_tokens: int
    round: int  # from 0; the warm-up rounds come first
    step: int  # from 1, over the whole benchmark
    parallel: int | None = None  # streams at once; None: the one-stream run
    given: str = ""  # the model as named: edgeinfer loads it so (a catalog name's route)


def run_bench(
    settings: BenchSettings,
    *,
    progress: ProgressLine | None = None,
    runner: Runner = run_in_fresh_process,
    machine: dict[str, Any] | None = None,
    command: list[str] | None = None,
) -> BenchReport:
    """Measure every model in ``settings``; returns the report, partial when interrupted
    (``report.interrupted``) or when edgeinfer itself failed (``report.errors``)."""
    from ..machine.busy import busy_record
    from ..machine.inventory import devices

    s = settings.checked()
    progress = progress or ProgressLine()
    machine = machine if machine is not None else {**devices().to_dict(), "busy": busy_record()}
    report = _new_report(s, machine, command)
    bench = _Bench(s, progress, runner, report, rounds=s.warmup + s.repetitions)
    try:
        for index, model in enumerate(s.models):
            _bench_model(bench, index, model)
    except KeyboardInterrupt:
        report.interrupted = True
    except EdgeInferError as exc:
        report.errors.append(f"error: {exc}")
        if not report.measured():
            progress.clear()
            raise
    finally:
        progress.clear()
    return report


def _new_report(
    s: BenchSettings, machine: dict[str, Any], command: list[str] | None
) -> BenchReport:
    settings_record = asdict(s)
    settings_record["models"] = list(s.models)
    return BenchReport(
        settings=settings_record,
        machine=machine,
        versions=versions(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command or [],
    )


def _bench_model(bench: _Bench, index: int, model: str) -> None:
    """Every configuration of one model, round by round, edgeinfer and then its peers."""
    from ..loader import resolve

    s = bench.settings
    source = resolve(model)  # a name or path that is no model fails here, in one line
    peers = _peers(bench, source)
    failed: set[Peer] = set()
    configurations = product(s.threads, s.prompt_tokens, s.parallel or (None,), range(bench.rounds))
    for i, (threads, n_prompt, streams, rep) in enumerate(configurations):
        step = index * bench.per_model + i + 1
        run = _Run(source, threads, n_prompt, rep, step=step, parallel=streams, given=model)
        ours = _run_edgeinfer(bench, run)
        # peers run what edgeinfer ran: its prompt ids, banned ids, device, context
        handed = {key: ours.get(key) for key in _HANDED}
        for peer in peers:
            if peer not in failed and not _run_peer(bench, run, peer, handed):
                failed.add(peer)


_HANDED = ("prompt_ids", "ban_ids", "device", "provider", "n_gpu_layers", "context_length")


def _peers(bench: _Bench, source: Any) -> list[Peer]:
    """The peers installed for this model (--compare); the missing ones noted."""
    if not bench.settings.compare:
        return []
    peers, skipped = peers_for(source.path, source.format, bench.settings.peer_models)
    if bench.settings.parallel:  # only the peers that batch run many streams at once
        skipped += [f"skipping {p.engine} at --parallel: it runs one sequence at a time"
                    for p in peers if p.engine not in PARALLEL_ENGINES]  # fmt: skip
        peers = [p for p in peers if p.engine in PARALLEL_ENGINES]
    # said once, in the report: a missing peer is known before any run, nothing to warn of
    bench.report.notes.extend(skipped)
    return peers


def _run_edgeinfer(bench: _Bench, run: _Run) -> dict[str, Any]:
    """edgeinfer's run; its failure ends the benchmark (there is nothing to compare with)."""
    bench.progress.show(f"{_where(bench, run)} edgeinfer {_label(bench, run)}")
    path = run.source.path
    try:
        model = as_named(run.given, path)
        ours = bench.runner({**_spec(bench, run), "engine": "edgeinfer", "model": model})
    except RunFailed as exc:
        cls = _ERRORS.get(exc.kind, BackendUnavailableError)
        raise cls(f"{run.source.name}: {exc}") from None
    _keep(bench, run, "edgeinfer", str(path), ours)
    return ours


def _run_peer(bench: _Bench, run: _Run, peer: Peer, handed: dict[str, Any]) -> bool:
    """A peer's run; False when it failed (it is left out, with a note, from then on)."""
    bench.progress.show(f"{_where(bench, run)} {peer.engine} {_label(bench, run)}")
    spec = {**_spec(bench, run), **handed, "engine": peer.engine, "model": str(peer.path)}
    try:
        theirs = bench.runner(spec)
    except RunFailed as exc:
        line = one_line(f"{peer.engine} failed on {peer.path.name}, left out: {exc}", 2000)
        bench.progress.say(line)
        bench.report.notes.append(line)
        return False
    _keep(bench, run, peer.engine, str(peer.path), theirs)
    return True


def _keep(bench: _Bench, run: _Run, engine: str, engine_model: str, record: dict[str, Any]) -> None:
    """A measured run joins its row; a warm-up run is dropped."""
    if run.round < bench.settings.warmup:
        return
    row = bench.report.row(run.source.name, str(run.source.path), engine, engine_model,
                           run.threads, run.prompt_tokens, bench.settings.new_tokens,
                           parallel=run.parallel)  # fmt: skip
    row.runs.append(record)


def _spec(bench: _Bench, run: _Run) -> dict[str, Any]:
    """What every engine is asked in this round (the worker's input, less engine and model)."""
    s = bench.settings
    return {
        **({"parallel": run.parallel} if run.parallel is not None else {}),
        **({"route": s.engine} if s.engine != "auto" else {}),
        **({"speculative": s.speculative} if s.speculative != "off" else {}),
        "prompt_tokens": run.prompt_tokens,
        "new_tokens": s.new_tokens,
        "threads": run.threads,
        "context_length": s.context_length,
        "device": s.device,
        "memory_budget": s.memory_budget,
        "timeout_s": s.timeout_s,
    }


def _label(bench: _Bench, run: _Run) -> str:
    s = bench.settings
    if run.round >= s.warmup:
        return f"run {run.round - s.warmup + 1}/{s.repetitions}"
    return f"warm-up {run.round + 1}/{s.warmup}"


def _where(bench: _Bench, run: _Run) -> str:
    s = bench.settings
    test = f"pp{run.prompt_tokens}+tg{s.new_tokens} t{run.threads}"
    test += f" x{run.parallel}" if run.parallel is not None else ""
    return f"bench [{run.step}/{bench.total}] {run.source.name} {test}"
