"""What a benchmark measured, summarised: the terminal table (like llama-bench's), Markdown,
one JSON object with stable keys, and a bar chart."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .records import BenchResultError, check_report

__all__ = ["BenchReport", "Row", "done_tok_s", "summarize"]

SCHEMA = "edgeinfer.bench/1"
MB = 1e6
# the figures summarised in every row: name in the row -> (key in a run, scale)
FIGURES = {
    "pp_tok_s": ("prefill_tok_s", 1.0),
    "tg_tok_s": ("decode_tok_s", 1.0),
    "ttft_ms": ("ttft_s", 1000.0),
    "peak_rss_mb": ("peak_rss_bytes", 1 / MB),
}
# and in the rows of many streams at once (--parallel); tg_tok_s is then the aggregate
PARALLEL_FIGURES = {
    "steady_tg_tok_s": ("steady_decode_tok_s", 1.0),
    "stream_tg_tok_s": ("per_stream_decode_tok_s", 1.0),
    "ttft_p50_ms": ("ttft_p50_s", 1000.0),
    "ttft_p95_ms": ("ttft_p95_s", 1000.0),
    "join_ttft_ms": ("join_ttft_s", 1000.0),
}

_ROW_KEYS = ("model", "model_path", "engine", "engine_model", "threads", "prompt_tokens",
             "new_tokens")  # fmt: skip


def done_tok_s(run: dict[str, Any]) -> float:
    """A parallel run's tokens over the time from the requests to its last token (each
    stream's time to first token and its decode, the longest of them): prefill, waiting and
    decode all count, however an engine orders them."""
    streams = [s for s in run.get("streams", ()) if s["tokens"]]
    ends = [
        s["ttft_s"] + ((s["tokens"] - 1) / s["decode_tok_s"] if s["decode_tok_s"] > 0 else 0.0)
        for s in streams
    ]
    span = max(ends, default=0.0)
    return sum(s["tokens"] for s in streams) / span if span > 0 else 0.0


def summarize(values: list[float]) -> dict[str, float]:
    """n, mean, stddev (sample; 0 for one value), median, min and max."""
    if not values:
        return {"n": 0, **dict.fromkeys(("mean", "stddev", "median", "min", "max"), math.nan)}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "stddev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


@dataclass
class Row:
    """One configuration (model, engine, threads, prompt length) and its measured runs."""

    model: str
    model_path: str
    engine: str
    engine_model: str  # the file or folder this engine loaded
    threads: int
    prompt_tokens: int
    new_tokens: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    parallel: int | None = None  # streams at once (--parallel); None: the one-stream run

    @property
    def key(self) -> tuple[str, int, int, int | None]:
        return (self.model, self.threads, self.prompt_tokens, self.parallel)

    def figure(self, name: str) -> dict[str, float]:
        if name == "done_tok_s":
            return summarize([done_tok_s(r) for r in self.runs])
        source, scale = FIGURES.get(name) or PARALLEL_FIGURES[name]
        return summarize([float(r[source]) * scale for r in self.runs])

    def pooled_ttft_ms(self) -> dict[str, float]:
        """p50 and p95 of every stream's TTFT over all runs of a parallel row."""
        ttfts = [
            1000.0 * s["ttft_s"] for r in self.runs for s in r.get("streams", ()) if s["tokens"]
        ]
        return {"p50": _quantile(ttfts, 0.5), "p95": _quantile(ttfts, 0.95)}

    def last(self, key: str) -> Any:
        return self.runs[-1].get(key) if self.runs else None


@dataclass
class BenchReport:
    settings: dict[str, Any]
    machine: dict[str, Any]
    versions: dict[str, str]
    created: str
    command: list[str]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # peers skipped, peers that failed
    errors: list[str] = field(default_factory=list)
    interrupted: bool = False
    agreement: dict[str, Any] | None = None  # --agreement: the reference and each engine's

    def row(
        self,
        model: str,
        model_path: str,
        engine: str,
        engine_model: str,
        threads: int,
        prompt_tokens: int,
        new_tokens: int,
        parallel: int | None = None,
    ) -> Row:
        wanted = (model, engine, engine_model, threads, prompt_tokens, parallel)
        for r in self.rows:
            if (
                r.model,
                r.engine,
                r.engine_model,
                r.threads,
                r.prompt_tokens,
                r.parallel,
            ) == wanted:
                return r
        made = Row(model, model_path, engine, engine_model, threads, prompt_tokens, new_tokens,
                   parallel=parallel)  # fmt: skip
        self.rows.append(made)
        return made

    def measured(self) -> list[Row]:
        return [r for r in self.rows if r.runs]

    def ratio(self, row: Row, figure: str) -> float | None:
        """This row's mean over edgeinfer's mean in the same configuration."""
        base = next(
            (r for r in self.measured() if r.engine == "edgeinfer" and r.key == row.key), None
        )
        if base is None:
            return None
        ours = base.figure(figure)["mean"]
        theirs = row.figure(figure)["mean"]
        ratio = theirs / ours if ours > 0 else math.inf
        return ratio if math.isfinite(ratio) else None

    def one_stream(self, row: Row, figure: str) -> float | None:
        """A parallel row's mean over the same engine's mean with one stream (--parallel 1)."""
        base = next(
            (
                r
                for r in self.measured()
                if (r.engine, r.engine_model, r.parallel) == (row.engine, row.engine_model, 1)
                and r.key[:3] == row.key[:3]
            ),
            None,
        )
        if base is None or row.parallel is None:
            return None
        ours = base.figure(figure)["mean"]
        ratio = row.figure(figure)["mean"] / ours if ours > 0 else math.inf
        return ratio if math.isfinite(ratio) else None

    def agreement_of(self, row: Row) -> dict[str, Any] | None:
        """The agreement figures of ``row``'s engine on its model (--agreement), or None."""
        from .agreement import figures_of

        return figures_of(self.agreement, row) if self.agreement is not None else None

    def _agreement_cells(self, r: Row) -> list[str]:
        if self.agreement is None:
            return []
        a = self.agreement_of(r)
        return ["-", "-"] if a is None else [f"{a['top1_agreement']:.1%}",
                                             f"{a['mean_greedy_prefix']:.1f}"]  # fmt: skip

    # -- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "created": self.created,
            "command": self.command,
            "versions": self.versions,
            "machine": self.machine,
            "settings": self.settings,
            "interrupted": self.interrupted,
            "notes": self.notes,
            "errors": self.errors,
            "agreement": self.agreement,
            "results": [self._row_dict(r) for r in self.measured()],
        }

    def _row_dict(self, r: Row) -> dict[str, Any]:
        plan = r.last("plan_total_bytes")
        return {
            "model": r.model,
            "model_path": r.model_path,
            "engine": r.engine,
            "engine_model": r.engine_model,
            "provider": r.last("provider"),
            "device": r.last("device"),
            "threads": r.threads,
            "prompt_tokens": r.prompt_tokens,
            "new_tokens": r.new_tokens,
            "context_length": r.last("context_length"),
            "repetitions": len(r.runs),
            "tokens_generated_min": min(int(x["tokens"]) for x in r.runs),
            **{name: r.figure(name) for name in FIGURES},
            "plan_total_mb": plan / MB if plan else None,
            "ratio_to_edgeinfer": {
                "pp_tok_s": self.ratio(r, "pp_tok_s"),
                "tg_tok_s": self.ratio(r, "tg_tok_s"),
            },
            **(self._parallel_dict(r) if r.parallel is not None else {}),
            "agreement": self.agreement_of(r),
            "runs": [
                {k: v for k, v in x.items() if k not in ("prompt_ids", "ban_ids")} for x in r.runs
            ],
        }

    def _parallel_dict(self, r: Row) -> dict[str, Any]:
        """A parallel row's own figures: tg_tok_s is the aggregate of its streams."""
        return {
            "parallel": r.parallel,
            **{name: r.figure(name) for name in PARALLEL_FIGURES},
            "done_tok_s": r.figure("done_tok_s"),
            "done_tok_s_ratio_to_edgeinfer": self.ratio(r, "done_tok_s"),
            "ttft_pooled_ms": r.pooled_ttft_ms(),
            "ratio_to_one_stream": {
                "tg_tok_s": self.one_stream(r, "tg_tok_s"),
                "steady_tg_tok_s": self.one_stream(r, "steady_tg_tok_s"),
                "join_ttft_ms": self.one_stream(r, "join_ttft_ms"),
            },
        }

    @classmethod
    def from_dict(cls, data: Any, what: str = "the bench result") -> BenchReport:
        """A report saved with ``to_dict`` (``--json``), to print or plot again; every field
        it reads is checked first (BenchResultError names ``what`` and the field)."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise BenchResultError(
                f"{what} is not an edgeinfer bench result (expected schema {SCHEMA!r}); make "
                "one with 'edgeinfer bench MODEL --json > FILE'"
            )
        data = check_report(data, what)
        report = cls(
            settings=data["settings"],
            machine=data["machine"],
            versions=data["versions"],
            created=data["created"],
            command=list(data["command"]),
            notes=list(data["notes"]),
            errors=list(data["errors"]),
            interrupted=data["interrupted"],
            agreement=data.get("agreement"),
        )
        for r in data["results"]:
            row = Row(*(r[key] for key in _ROW_KEYS), runs=[dict(x) for x in r["runs"]],
                      parallel=r.get("parallel"))  # fmt: skip
            report.rows.append(row)
        return report

    # -- tables -----------------------------------------------------------------------------

    def table(self, markdown: bool = False) -> str:
        rows = self.measured()
        single = [self._cells(r) for r in rows if r.parallel is None]
        many = [self._parallel_cells(r) for r in rows if r.parallel is not None]
        if not single and not many:
            return "(nothing measured)\n"
        tables = []
        extra = _AGREEMENT_HEADER if self.agreement is not None else []
        extra = [*extra, "accepted"] if self.speculative else extra
        for header, body in ((_HEADER + extra, single), (_PARALLEL_HEADER + extra, many)):
            if body:
                lines = _markdown(header, body) if markdown else _boxed(header, body)
                tables.append("\n".join(lines) + "\n")
        return "\n".join(tables)

    def _parallel_cells(self, r: Row) -> list[str]:
        """One row of the parallel table, in the order of _PARALLEL_HEADER."""
        ratios = [self.one_stream(r, "tg_tok_s"), self.one_stream(r, "join_ttft_ms"),
                  self.ratio(r, "tg_tok_s"), self.ratio(r, "done_tok_s")]  # fmt: skip
        pooled = r.pooled_ttft_ms()
        return [
            r.model,
            r.engine,
            str(r.last("provider") or ""),
            str(r.threads),
            f"pp{r.prompt_tokens}+tg{r.new_tokens}",
            str(r.parallel),
            _pm(r.figure("tg_tok_s"), 1),
            _pm(r.figure("steady_tg_tok_s"), 1),
            _pm(r.figure("stream_tg_tok_s"), 1),
            _pm(r.figure("done_tok_s"), 1),
            f"{pooled['p50']:.1f}",
            f"{pooled['p95']:.1f}",
            _pm(r.figure("join_ttft_ms"), 1),
            f"{r.figure('peak_rss_mb')['max']:.1f}",
            *(f"{x:.2f}" if x is not None else "-" for x in ratios),
            *self._agreement_cells(r),
            *self._speculative_cells(r),
        ]

    def _cells(self, r: Row) -> list[str]:
        """One row of the table, in the order of _HEADER."""
        plan = r.last("plan_total_bytes")
        ratio = self.ratio(r, "tg_tok_s")
        test = f"pp{r.prompt_tokens}+tg{r.new_tokens}"
        short = int(min(x["tokens"] for x in r.runs))
        if short < r.new_tokens:
            test += f" ({short} generated)"
        return [
            r.model,
            r.engine,
            str(r.last("provider") or ""),
            str(r.threads),
            test,
            _pm(r.figure("pp_tok_s"), 1),
            _pm(r.figure("tg_tok_s"), 2),
            _pm(r.figure("ttft_ms"), 1),
            f"{r.figure('peak_rss_mb')['max']:.1f}",
            f"{plan / MB:.1f}" if plan else "-",
            f"{ratio:.2f}" if ratio is not None else "-",
            *self._agreement_cells(r),
            *self._speculative_cells(r),
        ]

    @property
    def speculative(self) -> bool:
        return str(self.settings.get("speculative", "off")) != "off"

    def _speculative_cells(self, r: Row) -> list[str]:
        """With --speculative: drafted tokens the model kept, over every run of the row."""
        if not self.speculative:
            return []
        drafted, accepted = accepted_tokens(r.runs)
        if drafted is None:
            return ["-"]  # a peer's row, or a run that drafted nothing it could report
        share = f" ({100 * accepted / drafted:.0f}%)" if drafted else ""
        return [f"{accepted}/{drafted}{share}"]

    def caption(self) -> str:
        s = self.settings
        name = (
            f"{self.machine.get('cpu_model', '?')}, {self.machine.get('physical_cores', '?')} "
            f"cores, {self.machine.get('arch', '?')}"
        )
        vs = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        return (
            f"mean ± stddev over {s['repetitions']} runs after {s['warmup']} warm-up, engines "
            f"interleaved, one process per run; {s['new_tokens']} greedy tokens after the "
            f"prompt, context {s['context_length']}; peak RSS is the largest run's; tg vs "
            f"edgeinfer = the row's tg t/s / edgeinfer's{_START_TO_END if self._many() else ''}. "
            f"{name}, {self.created[:10]}. {vs}"
        )

    def _many(self) -> bool:
        return any(r.parallel is not None for r in self.measured())

    def text(self, markdown: bool = False) -> str:
        out = [self.table(markdown=markdown)]
        if markdown:
            out.insert(0, f"`{' '.join(self.command)}`\n\n")
            out.append(f"\n{self.caption()}\n")
        busy = self.machine.get("busy")  # how busy the machine was when the bench began
        if isinstance(busy, dict) and isinstance(busy.get("line"), str):
            out.append(("\n" if markdown else "") + f"cpu load at start: {busy['line']}\n")
        if self.agreement is not None:
            from .agreement import notes_of

            gap = "\n" if markdown else ""
            out.extend(f"{gap}{line}\n" for line in notes_of(self.agreement))
        for line in self.notes + self.errors:
            out.append(("\n" if markdown else "") + line + "\n")
        if self.interrupted:
            out.append("interrupted: the rows above hold the runs finished before Ctrl-C\n")
        return "".join(out)

    # -- chart ------------------------------------------------------------------------------

    def plot(self, path: Path) -> None:
        """Bars of decode tok/s (± stddev) and peak RSS per configuration, as an image."""
        from .plot import figure, pyplot, save

        plt = pyplot()
        rows = self.measured()
        if not rows:
            return
        tags = [self.agreement_of(r) for r in rows]
        fig = figure(plt, rows, self.settings["new_tokens"])
        if any(tags):
            from .agreement import tag_bars

            tag_bars(fig.axes[0], [r.figure("tg_tok_s")["mean"] for r in rows], tags)
        try:
            save(fig, Path(path))
        finally:
            plt.close(fig)


_HEADER = ["model", "engine", "provider", "threads", "test", "pp t/s", "tg t/s", "TTFT ms",
           "peak RSS MB", "plan MB", "tg vs edgeinfer"]  # fmt: skip
_PARALLEL_HEADER = ["model", "engine", "provider", "threads", "test", "streams",
                    "tg t/s (all)", "tg t/s (all decoding)", "tg t/s per stream",
                    "t/s start to end", "TTFT p50 ms", "TTFT p95 ms", "join TTFT ms",
                    "peak RSS MB", "tg vs 1 stream", "join TTFT vs alone", "tg vs edgeinfer",
                    "start to end vs edgeinfer"]  # fmt: skip
_START_TO_END = (
    "; t/s start to end = every stream's tokens over the time from the requests to the last "
    "token (prefill, waiting and decode, however the engine orders them)"
)
_AGREEMENT_HEADER = ["top-1 vs ref", "greedy prefix"]  # with --agreement
_RIGHT = {3, *range(5, 20)}  # the columns of numbers, right-aligned


def _markdown(header: list[str], body: list[list[str]]) -> list[str]:
    rule = " | ".join("---:" if i in _RIGHT else "---" for i in range(len(header)))
    return [f"| {' | '.join(header)} |", f"| {rule} |", *(f"| {' | '.join(b)} |" for b in body)]


def _boxed(header: list[str], body: list[list[str]]) -> list[str]:
    """The terminal table: columns padded to their widest cell."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def fmt(cells: list[str]) -> str:
        padded = (
            c.rjust(w) if i in _RIGHT else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return f"| {' | '.join(padded)} |"

    rule = " | ".join(
        ("-" * (w - 1) + ":") if i in _RIGHT else "-" * w for i, w in enumerate(widths)
    )
    return [fmt(header), f"| {rule} |", *(fmt(b) for b in body)]


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated between nearest ranks; nan if none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _pm(s: dict[str, float], digits: int) -> str:
    """The mean ± its spread; one run has no spread to show."""
    if s.get("n", 2) < 2:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['stddev']:.{digits}f}"


def accepted_tokens(runs: list[dict[str, Any]]) -> tuple[int | None, int]:
    """Drafted and accepted tokens over ``runs`` (edgeinfer's engine_stats); None drafted
    when no run reports them."""
    stats = [x["engine_stats"] for x in runs if isinstance(x.get("engine_stats"), dict)]
    if not stats:
        return None, 0
    return (
        sum(int(s.get("draft_tokens") or 0) for s in stats),
        sum(int(s.get("accepted_tokens") or 0) for s in stats),
    )
