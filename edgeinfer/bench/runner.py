"""Runs a benchmark: every configuration, every engine, one fresh process per run, engines
interleaved round by round so the machine's noise falls on all of them alike."""

from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
from .peers import Peer, peers_for
from .report import BenchReport
from .worker import RESULT_MARK

__all__ = ["BenchSettings", "run_bench"]

_ERRORS: dict[str, type[EdgeInferError]] = {
    cls.__name__: cls
    for cls in (
        ModelLoadError,
        BackendUnavailableError,
        MemoryBudgetError,
        ConversionError,
        InvalidRequestError,
    )
}
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
        threads = self.threads or (LoadConfig().resolved_threads,)
        _positive_list("--threads", threads)
        if max(threads) > MAX_THREADS:
            raise InvalidRequestError(f"--threads {max(threads)} is invalid: at most {MAX_THREADS}")
        need = max(self.prompt_tokens) + self.new_tokens
        context = self.context_length
        if context is None:
            context = max(1024, math.ceil(need / 256) * 256)
        elif isinstance(context, bool) or not isinstance(context, int) or context < need:
            raise InvalidRequestError(
                f"--context-length {context!r} is too small: the longest prompt and the reply "
                f"need {need} tokens"
            )
        if self.peer_models and not self.compare:
            raise InvalidRequestError("--peer-model names a peer's model: add --compare")
        return BenchSettings(
            models=tuple(self.models),
            prompt_tokens=tuple(self.prompt_tokens),
            new_tokens=self.new_tokens,
            repetitions=self.repetitions,
            warmup=self.warmup,
            threads=tuple(threads),
            device=self.device,
            memory_budget=self.memory_budget,
            context_length=context,
            compare=self.compare,
            peer_models=tuple(self.peer_models),
        )


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


def run_in_fresh_process(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in a new interpreter; RunFailed when the engine fails or the process dies."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer.bench.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(json.dumps(spec))
    except BaseException:  # Ctrl-C: the run is abandoned, its process with it
        proc.kill()
        proc.wait()
        raise
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_MARK):
            record = json.loads(line[len(RESULT_MARK) :])
            if "error" in record:
                raise RunFailed(record["error"]["type"], record["error"]["message"])
            return record
    tail = " | ".join(err.strip().splitlines()[-3:])[-400:]
    how = (
        f"was killed by signal {-proc.returncode}"
        if proc.returncode < 0
        else (f"exited with status {proc.returncode}")
    )
    raise RunFailed("crash", f"the process {how} without a result{': ' + tail if tail else ''}")


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
    from ..inventory import devices
    from ..loader import resolve

    s = settings.checked()
    progress = progress or ProgressLine()
    settings_record = asdict(s)
    settings_record["models"] = list(s.models)
    report = BenchReport(
        settings=settings_record,
        machine=machine if machine is not None else devices().to_dict(),
        versions=versions(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command or [],
    )
    rounds = s.warmup + s.repetitions
    total = len(s.models) * len(s.threads) * len(s.prompt_tokens) * rounds
    step = 0
    try:
        for model in s.models:
            source = resolve(model)  # a name or path that is no model fails here, in one line
            peers: list[Peer] = []
            if s.compare:
                peers, skipped = peers_for(source.path, source.format, s.peer_models)
                for line in skipped:
                    progress.say(line)
                    report.notes.append(line)
            failed: set[Peer] = set()
            for threads, n_prompt, rep in product(s.threads, s.prompt_tokens, range(rounds)):
                step += 1
                measured = rep >= s.warmup
                label = (
                    f"run {rep - s.warmup + 1}/{s.repetitions}"
                    if measured
                    else f"warm-up {rep + 1}/{s.warmup}"
                )
                where = (
                    f"bench [{step}/{total}] {source.name} pp{n_prompt}+tg{s.new_tokens} t{threads}"
                )
                base = {
                    "prompt_tokens": n_prompt,
                    "new_tokens": s.new_tokens,
                    "threads": threads,
                    "context_length": s.context_length,
                    "device": s.device,
                    "memory_budget": s.memory_budget,
                }

                progress.show(f"{where} edgeinfer {label}")
                try:
                    ours = runner({**base, "engine": "edgeinfer", "model": str(source.path)})
                except RunFailed as exc:
                    cls = _ERRORS.get(exc.kind, BackendUnavailableError)
                    raise cls(f"{source.name}: {exc}") from None
                if measured:
                    report.row(source.name, str(source.path), "edgeinfer", str(source.path),
                               threads, n_prompt, s.new_tokens).runs.append(ours)  # fmt: skip
                # peers run what edgeinfer ran: its prompt ids, banned ids, device, context
                handed = {
                    key: ours.get(key)
                    for key in (
                        "prompt_ids", "ban_ids", "device", "provider", "n_gpu_layers",
                        "context_length",
                    )
                }  # fmt: skip
                for peer in peers:
                    if peer in failed:
                        continue
                    progress.show(f"{where} {peer.engine} {label}")
                    try:
                        theirs = runner(
                            {**base, **handed, "engine": peer.engine, "model": str(peer.path)}
                        )
                    except RunFailed as exc:
                        failed.add(peer)
                        line = f"{peer.engine} failed on {peer.path.name}, left out: {exc}"
                        progress.say(line)
                        report.notes.append(line)
                        continue
                    if measured:
                        report.row(source.name, str(source.path), peer.engine, str(peer.path),
                                   threads, n_prompt, s.new_tokens).runs.append(theirs)  # fmt: skip
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
