"""What a results file under ``benchmarks/results/`` records about the run that wrote it.

The files were written by scripts of several ages, each with its own key names, so the
readers below name every key they accept; nothing is guessed from a value (an ``x86_64``
where a CPU model belongs is not a CPU, a kernel build is not a machine). A file that lacks
one of ``REQUIRED`` carries ``"conditions": {"unrecorded": [...], "note": ...}`` saying so;
nothing was filled in afterwards. New runs record all of it through
``benchmarks/conditions.py`` (``start()``/``finish()``: a ``conditions`` object).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REQUIRED = ("command", "cpu", "simd", "versions", "threads", "rounds", "load before",
            "load after")  # fmt: skip
LOADED = 2.0  # a 1-minute load average at or above this, on the 2-core machine: loaded
# the keys, at any depth, that hold a load average (a [1, 5, 15] minute triple, or the
# 1-minute figure alone) taken before or after the work
_BEFORE = {"loadavg_start", "loadavg_before", "load_average_start", "load_average_before",
           "load_average_at_start", "load_at_start", "load_avg_before", "loadavg_at_start",
           "load_before"}  # fmt: skip
_AFTER = {"loadavg_end", "loadavg_after", "load_average_end", "load_average_after",
          "load_average_at_end", "load_at_end", "load_avg_after", "loadavg_at_end",
          "load_after"}  # fmt: skip
_NOT_A_CPU = {"", "x86_64", "amd64", "aarch64", "arm64", "i686"}  # an architecture is no model
# CPU families the pages name, as the recorded model spells them
FAMILIES = {"Xeon": "Xeon", "EPYC": "EPYC", "Ryzen": "Ryzen", "Core": "Core(TM)"}


@dataclass(frozen=True)
class Recorded:
    """The conditions one results file records."""

    file: str
    command: bool
    cpu: str | None  # the CPU model as recorded
    simd: tuple[str, ...] | None  # the SIMD flags as recorded
    versions: bool
    threads: bool
    rounds: bool
    load_before: tuple[float, ...]  # every 1-minute load average taken before work
    load_after: tuple[float, ...]
    loads: tuple[float, ...]  # every load figure (1, 5 and 15 minutes)
    quiet_flag: bool | None  # benchmarks/conditions.py's own verdict, where it wrote one
    unrecorded: tuple[str, ...]  # what the file's conditions note says is unknown

    @property
    def load_recorded(self) -> bool:
        return bool(self.load_before or self.load_after)

    @property
    def loaded(self) -> bool:
        """Taken at a load of 2 or more (1 minute) at its start or end, or not known quiet.
        A file with benchmarks/conditions.py's verdict is judged by it at its end (the run's
        own threads less: ``end_limit``), and by this rule at its start."""
        if self.quiet_flag is not None:
            return not self.quiet_flag or max(self.load_before, default=LOADED) >= LOADED
        return not self.load_recorded or max(self.load_before + self.load_after) >= LOADED

    @property
    def family(self) -> str | None:
        for name, spelled in FAMILIES.items():
            if self.cpu and spelled in self.cpu:
                return name
        return None

    def missing(self) -> list[str]:
        have = {
            "command": self.command,
            "cpu": self.cpu is not None,
            "simd": self.simd is not None,
            "versions": self.versions,
            "threads": self.threads,
            "rounds": self.rounds,
            "load before": bool(self.load_before),
            "load after": bool(self.load_after),
        }
        return [name for name in REQUIRED if not have[name]]


def _parts(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The objects that describe the run: the top, its machine, settings, workload and
    conditions, and the same inside each report of a file that holds several."""
    tops = [data, *(r for r in (data.get("reports") or {}).values() if isinstance(r, dict))]
    for top in tops:
        yield top
        for key in ("machine", "settings", "workload", "conditions"):
            if isinstance(top.get(key), dict):
                yield top[key]
        conditions = top.get("conditions")
        if isinstance(conditions, dict) and isinstance(conditions.get("cpu"), dict):
            yield {"conditions_cpu": conditions["cpu"]}


def _cpu(parts: list[dict[str, Any]]) -> tuple[str | None, tuple[str, ...] | None]:
    model: str | None = None
    simd: tuple[str, ...] | None = None
    for part in parts:
        cpu = part.get("conditions_cpu")
        candidates = [part.get("cpu_model"), part.get("cpu")]
        if isinstance(cpu, dict):
            candidates.append(cpu.get("model"))
            simd = tuple(cpu.get("simd") or ()) if "simd" in cpu else simd
        for value in candidates:
            if isinstance(value, str) and value.strip() not in _NOT_A_CPU and model is None:
                model = value.strip()
        if isinstance(part.get("cpu_features"), list):
            simd = tuple(part["cpu_features"])
    return model, simd


def _loads(node: Any, when: str | None = None) -> Iterator[tuple[str, list[float]]]:
    """(before|after, the figures) for every load average in the file, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            side = "before" if key in _BEFORE else "after" if key in _AFTER else None
            if key in ("load_average", "loadavg") and isinstance(value, dict):
                yield from _loads({f"load_{k}": v for k, v in value.items()}, when)
            elif key in ("load_average", "loadavg") and isinstance(value, list):
                yield from _loads({"load_before": value}, when)
            elif side and isinstance(value, int | float) and not isinstance(value, bool):
                yield side, [float(value)]
            elif side and isinstance(value, list) and value:
                if all(isinstance(v, int | float) for v in value):
                    yield side, [float(v) for v in value]
            else:
                yield from _loads(value, when)
    elif isinstance(node, list):
        for value in node:
            yield from _loads(value, when)


def _has(parts: list[dict[str, Any]], *keys: str) -> bool:
    return any(part.get(key) not in (None, "", [], {}) for part in parts for key in keys)


@functools.cache
def recorded(file: str) -> Recorded:
    data = json.loads((RESULTS / file).read_text(encoding="utf-8"))
    parts = list(_parts(data))
    cpu, simd = _cpu(parts)
    before, after, every = [], [], []
    for side, figures in _loads(data):
        (before if side == "before" else after).append(figures[0])
        every.extend(figures)
    conditions = data.get("conditions") if isinstance(data.get("conditions"), dict) else {}
    quiet = conditions.get("quiet")
    runs = data.get("runs") if isinstance(data.get("runs"), list) else []
    runs = [r for r in runs if isinstance(r, dict)]  # a per-run record counts as recorded
    rounds = _has(parts, "rounds", "repetitions", "rounds_done") or any("round" in r for r in runs)
    threads = _has(parts, "threads") or any("threads_used" in r for r in runs)
    versions = _has(parts, "versions", "edgeinfer", "onnxruntime", "llama_cpp_python",
                    "onnxruntime_version", "llama_cpp_version")  # fmt: skip
    return Recorded(
        file=file,
        command=_has(parts, "command"),
        cpu=cpu,
        simd=simd,
        versions=versions,
        threads=threads,
        rounds=rounds,
        load_before=tuple(before),
        load_after=tuple(after),
        loads=tuple(every),
        quiet_flag=quiet if isinstance(quiet, bool) else None,
        unrecorded=tuple(conditions.get("unrecorded") or ()),
    )


def results_files() -> list[str]:
    return sorted(p.name for p in RESULTS.glob("*.json"))


# -- what the text says about a figure's machine and load --------------------------------

_FAMILY_WORDS = {name: re.compile(rf"\b{name}\b") for name in FAMILIES}
_THIS_MACHINE = re.compile(
    r"\b(?:this|the same|the project's|this project's) (?:2-core )?(?:x86 )?"
    r"(?:AVX2-only )?(?:machine|CPU)\b|\bthe (?:2-core )?CI machine\b"
)
_AVX2 = re.compile(r"\bAVX2(?:-only)?\b(?![/-])")
_AMX = re.compile(r"\bAMX\b(?!/)")
_UNRECORDED = re.compile(r"not recorded|unrecorded|records? no\b|recorded neither")
_FIELD_WORDS = {"machine": r"machine|CPU", "load": r"load", "command": r"command",
                "simd": r"SIMD|flags"}  # fmt: skip
_LOADED_WORDS = re.compile(r"\bloaded\b|\bsaturated\b")
_QUIET_WORDS = re.compile(r"\bquiet\b|\bidle machine\b|\ban idle\b")
MET = re.compile(r"\bmet\b|\btargets? holds?\b|\bholds on both\b")
_NEGATED = re.compile(r"\b(?:not|neither|never|no)\b(?:(?!\.\s)[^;])*\bmet\b")


_RESULTS_NAME = re.compile(r"[\w.\-]+\.json")
_BOUND = re.compile(r"[();]|\.(?=\s|$)")  # a clause ends at a bracket, a semicolon, a full stop


def _clauses(text: str) -> Iterator[str]:
    """Each clause that says something was not recorded."""
    for m in _UNRECORDED.finditer(text):
        before = [b.end() for b in _BOUND.finditer(text, 0, m.start())]
        after = _BOUND.search(text, m.end())
        yield text[(before[-1] if before else 0) : after.start() if after else len(text)]


def _fields(clause: str) -> set[str]:
    return {name for name, words in _FIELD_WORDS.items() if re.search(words, clause)}


def declared_unrecorded(text: str) -> set[str]:
    """What the text says was not recorded: each 'not recorded' clause and the fields it
    names (machine or CPU, load, command, SIMD flags)."""
    return set().union(*(_fields(c) for c in _clauses(text)))


def declared_by_file(text: str) -> dict[str, set[str]]:
    """The same for clauses that name their results file: they hold for the whole section."""
    said: dict[str, set[str]] = {}
    for clause in _clauses(text):
        for name in _RESULTS_NAME.findall(clause):
            said.setdefault(name.rpartition("/")[2], set()).update(_fields(clause))
    return said


def machine_problems(
    text: str, files: set[str], table: bool, said: dict[str, set[str]] | None = None
) -> list[str]:
    """The machine the text names against the one each file records: a named CPU family
    must be the file's, 'this machine' needs the CPU named beside it, 'AVX2' needs flags
    without AVX-512, 'AMX' flags with AMX; a table names its machine; a file that records
    no CPU is said to be unrecorded."""
    named = {name for name, rx in _FAMILY_WORDS.items() if rx.search(text)}
    here = declared_unrecorded(text)
    this, avx2, amx = (bool(rx.search(text)) for rx in (_THIS_MACHINE, _AVX2, _AMX))
    problems = []
    for file in sorted(files):
        rec = recorded(file)
        unknown = here | (said or {}).get(file, set())
        if rec.family is None:
            if "machine" not in unknown:
                problems.append(f"{file} records no CPU: the text must say the machine is "
                                "not recorded")  # fmt: skip
            continue
        if named and rec.family not in named:
            problems.append(f"the text names {'/'.join(sorted(named))}; {file} ran on {rec.cpu}")
        elif (table or this) and not named:
            problems.append(f"the text does not name the machine; {file} ran on {rec.cpu}")
        flags = rec.simd
        if (avx2 or amx) and flags is None and "simd" not in unknown:
            problems.append(f"the text names SIMD flags; {file} records none")
        elif avx2 and flags is not None and any(f.startswith("avx512") for f in flags):
            problems.append(f"the text says AVX2; {file} ran with AVX-512 ({rec.cpu})")
        elif amx and flags is not None and not any(f.startswith("amx") for f in flags):
            problems.append(f"the text says AMX; {file} has no AMX flags")
    return problems


def family_problems(sentence: str, files: set[str]) -> list[str]:
    """A sentence that names one CPU family beside its figures: each file records that
    family (a file with no CPU cannot be said to have run on one)."""
    named = {name for name, rx in _FAMILY_WORDS.items() if rx.search(sentence)}
    if len(named) != 1:
        return []
    (family,) = named
    return [f"the sentence says {family}; {file} records {recorded(file).cpu or 'no CPU'}"
            for file in sorted(files) if recorded(file).family != family]  # fmt: skip


def load_problems(
    text: str, files: set[str], labelled: set[str], said: dict[str, set[str]] | None = None
) -> list[str]:
    """Every figure from a loaded run is labelled so (a sourced load figure beside it, or
    'loaded'/'saturated'); a file with no load says so."""
    here = declared_unrecorded(text)
    problems = []
    for file in sorted(files):
        rec = recorded(file)
        if not rec.load_recorded:
            if "load" not in here | (said or {}).get(file, set()):
                problems.append(f"{file} records no load: the text must say so")
        elif rec.loaded and file not in labelled and not _LOADED_WORDS.search(text):
            top = max(rec.load_before + rec.load_after)
            problems.append(f"{file} ran at load {top:.1f}: label its figures as loaded")
    return problems


def quiet_problems(sentence: str, files: set[str]) -> list[str]:
    """A sentence that calls its figures' machine quiet or idle: every file is quiet."""
    if not _QUIET_WORDS.search(sentence):
        return []
    return [f"called quiet, but {file} is not known quiet" for file in sorted(files)
            if recorded(file).loaded]  # fmt: skip


def command_problems(
    text: str, files: set[str], said: dict[str, set[str]] | None = None
) -> list[str]:
    """A file that records no command is said so where its figures are used (the command
    the page shows beside them is then not the file's own record)."""
    here = declared_unrecorded(text)
    return [f"{file} records no command: the text must say so" for file in sorted(files)
            if not recorded(file).command
            and "command" not in here | (said or {}).get(file, set())]  # fmt: skip


def met_problems(text: str, files: set[str]) -> list[str]:
    """No target is declared met (in a sentence or a table row) from a loaded run or one
    whose load is unknown."""
    loaded = sorted(f for f in files if recorded(f).loaded)
    if loaded and MET.search(text) and not _NEGATED.search(text):
        return [f"a target is declared met from {', '.join(loaded)}: not shown at that load"]
    return []
