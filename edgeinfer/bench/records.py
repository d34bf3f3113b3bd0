"""What a run's result line and a saved benchmark hold, checked field by field.

Both come from outside the benchmark's own process: a peer's worker prints its result line
(and may die halfway through it, or print anything at all), and ``--from`` reads a file that
may have been cut short or edited. Both are parsed with bounds (``edgeinfer.bounded_json``)
and checked here: :func:`check_run` is the one check of a run's figures, used for a fresh
result line and for every run inside a saved report, so what the report code reads later
(``float(run["decode_tok_s"])``, ``min(run["tokens"] ...)``) cannot fail.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from ..bounded_json import parse_json
from ..errors import EdgeInferError

__all__ = [
    "BenchResultError",
    "check_agreement",
    "check_error",
    "check_report",
    "check_run",
    "one_line",
    "parse_result_line",
]

MAX_RESULT_LINE_BYTES = 4 * 2**20  # a run's line: its figures and up to ~100k prompt ids
MAX_IDS = 2**20
MAX_TOKEN_ID = 2**31
MAX_TEXT = 4096  # one provider name, note or error line
MAX_FIGURE = 1e18  # tokens/s, seconds or bytes beyond this are damage, not a measurement
# C0 and C1 control characters: a saved note must not move the cursor or clear a terminal
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class BenchResultError(EdgeInferError):
    """A run's result line or a saved benchmark result is damaged or incomplete."""


Check = Callable[[Any], bool]


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _positive(v: Any) -> bool:
    return _count(v) and v >= 1


def _figure(v: Any) -> bool:
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    return number and math.isfinite(v) and 0 <= v <= MAX_FIGURE


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_TEXT and not _CONTROL.search(v)


def one_line(text: str, limit: int = 500) -> str:
    """``text`` as one printable line of at most ``limit`` characters (a peer's stderr, an
    error message): whitespace runs become one space, other control characters ``?``."""
    return _CONTROL.sub("?", " ".join(text.split()))[:limit]


def _token_ids(v: Any) -> bool:
    return (
        isinstance(v, list) and len(v) <= MAX_IDS and all(_count(t) and t < MAX_TOKEN_ID for t in v)
    )


def _figures(v: Any) -> bool:
    return isinstance(v, dict) and all(x is None or _figure(x) for x in v.values())


def _or_none(check: Check) -> Check:
    return lambda v: v is None or check(v)


MAX_PARALLEL = 256  # streams in one run: LoadConfig.parallel's bound
_STREAM: dict[str, tuple[Check, str]] = {
    "tokens": (_count, "a whole number >= 0"),
    "ttft_s": (_figure, "a number >= 0"),
    "decode_tok_s": (_figure, "a number >= 0"),
}


def _parallel(v: Any) -> bool:
    return _positive(v) and v <= MAX_PARALLEL


def _parallel_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_PARALLEL and all(map(_parallel, v))


def _streams(v: Any) -> bool:
    """Each stream of a parallel run: its tokens, TTFT and decode rate."""
    return (
        isinstance(v, list)
        and len(v) <= MAX_PARALLEL
        and all(
            isinstance(s, dict) and all(k in s and c(s[k]) for k, (c, _) in _STREAM.items())
            for s in v
        )
    )


# field -> (check, what it must be); required fields first
_RUN_REQUIRED: dict[str, tuple[Check, str]] = {
    "tokens": (_count, "a whole number >= 0"),
    "ttft_s": (_figure, "a number >= 0"),
    "prefill_tok_s": (_figure, "a number >= 0"),
    "decode_tok_s": (_figure, "a number >= 0"),
    "peak_rss_bytes": (_figure, "a number >= 0"),
}
_RUN_OPTIONAL: dict[str, tuple[Check, str]] = {
    "provider": (_or_none(_text), "a printable string or null"),
    "device": (_or_none(_text), "a printable string or null"),
    "n_gpu_layers": (_or_none(_count), "a whole number or null"),
    "context_length": (_or_none(_count), "a whole number or null"),
    "plan_total_bytes": (_or_none(_figure), "a number >= 0 or null"),
    "prompt_ids": (_token_ids, "a list of token ids"),
    "ban_ids": (_token_ids, "a list of token ids"),
    "engine_stats": (_figures, "an object of numbers"),
    # a run of many streams at once (--parallel)
    "parallel": (_parallel, f"a whole number from 1 to {MAX_PARALLEL}"),
    "ttft_p50_s": (_figure, "a number >= 0"),
    "ttft_p95_s": (_figure, "a number >= 0"),
    "steady_decode_tok_s": (_figure, "a number >= 0"),
    "per_stream_decode_tok_s": (_figure, "a number >= 0"),
    "join_ttft_s": (_figure, "a number >= 0"),
    "streams": (_streams, "a list of streams, each with tokens, ttft_s and decode_tok_s"),
}
_ROW: dict[str, tuple[Check, str]] = {
    "model": (_text, "a printable string"),
    "model_path": (_text, "a printable string"),
    "engine": (_text, "a printable string"),
    "engine_model": (_text, "a printable string"),
    "threads": (_positive, "a whole number >= 1"),
    "prompt_tokens": (_positive, "a whole number >= 1"),
    "new_tokens": (_positive, "a whole number >= 1"),
}
_ROW_OPTIONAL: dict[str, tuple[Check, str]] = {
    "parallel": (_or_none(_parallel), f"a whole number from 1 to {MAX_PARALLEL} or null"),
}
_SETTINGS: dict[str, tuple[Check, str]] = {
    "repetitions": (_positive, "a whole number >= 1"),
    "warmup": (_count, "a whole number >= 0"),
    "new_tokens": (_positive, "a whole number >= 1"),
    "context_length": (_or_none(_positive), "a whole number or null"),
}
_SETTINGS_OPTIONAL: dict[str, tuple[Check, str]] = {
    "speculative": (_text, "a printable string"),
    "parallel": (_parallel_list, f"a list of whole numbers from 1 to {MAX_PARALLEL}"),
}

_MACHINE: dict[str, tuple[Check, str]] = {  # what the caption prints
    "cpu_model": (_or_none(_text), "a printable string"),
    "arch": (_or_none(_text), "a printable string"),
    "physical_cores": (_or_none(_count), "a whole number"),
}


def _texts(v: Any) -> bool:
    return isinstance(v, list) and all(map(_text, v))


_REPORT: dict[str, tuple[Check, str]] = {
    "created": (_text, "a printable string"),
    "command": (_texts, "a list of printable strings"),
    "versions": (lambda v: isinstance(v, dict) and _texts(list(v.values())), "an object of "
                 "printable strings"),
    "machine": (lambda v: isinstance(v, dict), "an object"),
    "settings": (lambda v: isinstance(v, dict), "an object"),
    "interrupted": (lambda v: isinstance(v, bool), "true or false"),
    "notes": (_texts, "a list of printable strings"),
    "errors": (_texts, "a list of printable strings"),
    "results": (lambda v: isinstance(v, list), "a list"),
}  # fmt: skip


def _described(value: Any) -> str:
    """A bad value named in one short line: its JSON type, and the value when short."""
    kinds = {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}
    kind = kinds.get(type(value), "a number" if isinstance(value, (int, float)) else "null")
    if isinstance(value, (list, dict)) or value is None:
        return kind
    shown = json.dumps(value) if not isinstance(value, int) or abs(value) < 10**30 else ""
    return f"{kind} {shown}" if shown and len(shown) <= 40 else kind


def _fields(
    data: Any, spec: dict[str, tuple[Check, str]], where: str, *, required: bool = True
) -> None:
    prefix = f"{where}." if where else ""
    for key, (check, wanted) in spec.items():
        if key not in data:
            if required:
                raise BenchResultError(f"{prefix}{key} is missing")
            continue
        if not check(data[key]):
            raise BenchResultError(f"{prefix}{key} must be {wanted}, not {_described(data[key])}")


def _object(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise BenchResultError(f"{where or 'the result'} must be an object, not {_described(data)}")
    return data


def check_run(
    data: Any, where: str = "", *, needs_ids: bool = False, parallel: int | None = None
) -> dict[str, Any]:
    """One run's figures, every field checked; BenchResultError names the first bad one.
    ``needs_ids``: edgeinfer's own run, whose prompt and banned ids the peers then run.
    ``parallel``: a run of that many streams at once, whose figures must all be there."""
    run = _object(data, where)
    _fields(run, _RUN_REQUIRED, where)
    _fields(run, _RUN_OPTIONAL, where, required=False)
    if needs_ids:
        _fields(run, {k: _RUN_OPTIONAL[k] for k in ("prompt_ids", "ban_ids")}, where)
    if parallel is not None:
        _fields(run, {k: _RUN_OPTIONAL[k] for k in _PARALLEL_FIGURES}, where)
        prefix = f"{where}." if where else ""
        if run["parallel"] != parallel or len(run["streams"]) != parallel:
            raise BenchResultError(
                f"{prefix}parallel must be the run's {parallel} streams, not "
                f"{_described(run['parallel'])} with {len(run['streams'])} streams"
            )
    return run


_PARALLEL_FIGURES = ("parallel", "ttft_p50_s", "ttft_p95_s", "steady_decode_tok_s",
                     "per_stream_decode_tok_s", "join_ttft_s", "streams")  # fmt: skip


def check_error(data: dict[str, Any]) -> tuple[str, str]:
    """The (type, message) of a worker's error record, the message cut to one short line."""
    error = _object(data.get("error"), "error")
    _fields(error, {"type": (_string, "a string"), "message": (_string, "a string")}, "error")
    return one_line(error["type"], 100), one_line(error["message"])


def _string(v: Any) -> bool:
    return isinstance(v, str)


def parse_result_line(text: str, what: str) -> dict[str, Any]:
    """A worker's result line (after the mark) parsed with bounds; the record is an object,
    either a run (checked by the caller) or ``{"error": {"type", "message"}}``."""
    record = parse_json(text, what=what, error=BenchResultError, max_bytes=MAX_RESULT_LINE_BYTES)
    return _object(record, what)


def check_report(data: Any, what: str) -> dict[str, Any]:
    """A saved report (``edgeinfer bench --json``), every field the report code reads
    checked; BenchResultError names the file (``what``) and the field."""
    try:
        return _check_report(data)
    except BenchResultError as exc:
        raise BenchResultError(f"{what}: {exc}") from None


def _fraction(v: Any) -> bool:
    return _figure(v) and v <= 1


MAX_AGREEMENT_ENGINES = 64
_AGREEMENT: dict[str, tuple[Check, str]] = {
    "reference": (_text, "a printable string"),
    "prompts": (_count, "a whole number >= 0"),
    "engines": (
        lambda v: isinstance(v, list) and len(v) <= MAX_AGREEMENT_ENGINES,
        f"a list of at most {MAX_AGREEMENT_ENGINES} engines",
    ),
}
_AGREEMENT_ENGINE: dict[str, tuple[Check, str]] = {
    "engine": (_text, "a printable string"),
    "engine_model": (_text, "a printable string"),
}
_AGREEMENT_FIGURES: dict[str, tuple[Check, str]] = {
    "provider": (_text, "a printable string"),
    "positions": (_count, "a whole number >= 0"),
    "top1_agreement": (_fraction, "a number from 0 to 1"),
    "decisive_positions": (_count, "a whole number >= 0"),
    "decisive_top1_agreement": (_fraction, "a number from 0 to 1"),
    "greedy_agreement": (_fraction, "a number from 0 to 1"),
    "greedy_agreement_beyond_ties": (_fraction, "a number from 0 to 1"),
    "mean_greedy_prefix": (_figure, "a number >= 0"),
    "mean_kl": (_figure, "a number >= 0"),
    "relative_kl": (_figure, "a number >= 0"),
}


def check_agreement(data: Any, where: str = "agreement") -> dict[str, Any]:
    """An agreement record (``edgeinfer bench --agreement``): the reference, then per engine
    either its figures or the one-line error that kept it from having them."""
    record = _object(data, where)
    _fields(record, _AGREEMENT, where)
    for i, engine in enumerate(record["engines"]):
        at = f"{where}.engines[{i}]"
        _fields(_object(engine, at), _AGREEMENT_ENGINE, at)
        if "error" in engine:
            _fields(engine, {"error": (_text, "a printable string")}, at)
        else:
            _fields(engine, _AGREEMENT_FIGURES, at)
    return record


def _check_report(data: Any) -> dict[str, Any]:
    report = _object(data, "")
    _fields(report, _REPORT, "")
    _fields(report["settings"], _SETTINGS, "settings")
    _fields(report["settings"], _SETTINGS_OPTIONAL, "settings", required=False)
    _fields(report["machine"], _MACHINE, "machine", required=False)
    for i, row in enumerate(report["results"]):
        where = f"results[{i}]"
        _fields(_object(row, where), _ROW, where)
        _fields(row, _ROW_OPTIONAL, where, required=False)
        runs = row.get("runs")
        if not isinstance(runs, list) or not runs:
            raise BenchResultError(f"{where}.runs must be a non-empty list of runs")
        for j, run in enumerate(runs):
            check_run(run, f"{where}.runs[{j}]", parallel=row.get("parallel"))
    if report.get("agreement") is not None:
        check_agreement(report["agreement"])
    return report
