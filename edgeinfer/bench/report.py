"""What a benchmark measured, summarised: the terminal table (like llama-bench's), Markdown,
one JSON object with stable keys, and a bar chart."""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from .records import BenchResultError, check_report

__all__ = ["BenchReport", "Row", "summarize"]

SCHEMA = "edgeinfer.bench/1"
MB = 1e6
# the figures summarised in every row: name in the row -> (key in a run, scale)
FIGURES = {
    "pp_tok_s": ("prefill_tok_s", 1.0),
    "tg_tok_s": ("decode_tok_s", 1.0),
    "ttft_ms": ("ttft_s", 1000.0),
    "peak_rss_mb": ("peak_rss_bytes", 1 / MB),
}

_ROW_KEYS = ("model", "model_path", "engine", "engine_model", "threads", "prompt_tokens",
             "new_tokens")  # fmt: skip


def summarize(values: list[float]) -> dict[str, float]:
    """mean, stddev (sample; 0 for one value), median, min and max."""
    if not values:
        return dict.fromkeys(("mean", "stddev", "median", "min", "max"), math.nan)
    return {
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

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.model, self.threads, self.prompt_tokens)

    def figure(self, name: str) -> dict[str, float]:
        source, scale = FIGURES[name]
        return summarize([float(r[source]) * scale for r in self.runs])

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

    def row(
        self,
        model: str,
        model_path: str,
        engine: str,
        engine_model: str,
        threads: int,
        prompt_tokens: int,
        new_tokens: int,
    ) -> Row:
        for r in self.rows:
            if (r.model, r.engine, r.engine_model, r.threads, r.prompt_tokens) == (
                model,
                engine,
                engine_model,
                threads,
                prompt_tokens,
            ):
                return r
        made = Row(model, model_path, engine, engine_model, threads, prompt_tokens, new_tokens)
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

    # -- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.measured():
            plan = r.last("plan_total_bytes")
            rows.append(
                {
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
                    "runs": [
                        {k: v for k, v in x.items() if k not in ("prompt_ids", "ban_ids")}
                        for x in r.runs
                    ],
                }
            )
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
            "results": rows,
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
        )
        for r in data["results"]:
            row = Row(*(r[key] for key in _ROW_KEYS), runs=[dict(x) for x in r["runs"]])
            report.rows.append(row)
        return report

    # -- tables -----------------------------------------------------------------------------

    def table(self, markdown: bool = False) -> str:
        header = [
            "model",
            "engine",
            "provider",
            "threads",
            "test",
            "pp t/s",
            "tg t/s",
            "TTFT ms",
            "peak RSS MB",
            "plan MB",
            "tg vs edgeinfer",
        ]
        body = []
        for r in self.measured():
            plan = r.last("plan_total_bytes")
            ratio = self.ratio(r, "tg_tok_s")
            test = f"pp{r.prompt_tokens}+tg{r.new_tokens}"
            short = int(min(x["tokens"] for x in r.runs))
            if short < r.new_tokens:
                test += f" ({short} generated)"
            body.append(
                [
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
                ]
            )
        if not body:
            return "(nothing measured)\n"
        right = {3, 5, 6, 7, 8, 9, 10}
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
        if markdown:
            lines = [
                "| " + " | ".join(header) + " |",
                "| "
                + " | ".join("---:" if i in right else "---" for i in range(len(header)))
                + " |",
            ]
            lines += ["| " + " | ".join(b) + " |" for b in body]
        else:

            def fmt(cells: list[str]) -> str:
                return (
                    "| "
                    + " | ".join(
                        c.rjust(w) if i in right else c.ljust(w)
                        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
                    )
                    + " |"
                )

            rule = (
                "| "
                + " | ".join(
                    ("-" * (w - 1) + ":") if i in right else "-" * w for i, w in enumerate(widths)
                )
                + " |"
            )
            lines = [fmt(header), rule, *(fmt(b) for b in body)]
        return "\n".join(lines) + "\n"

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
            f"edgeinfer = the row's tg t/s / edgeinfer's. {name}, {self.created[:10]}. {vs}"
        )

    def text(self, markdown: bool = False) -> str:
        out = [self.table(markdown=markdown)]
        if markdown:
            out.insert(0, f"`{' '.join(self.command)}`\n\n")
            out.append(f"\n{self.caption()}\n")
        for line in self.notes + self.errors:
            out.append(("\n" if markdown else "") + line + "\n")
        if self.interrupted:
            out.append("interrupted: the rows above hold the runs finished before Ctrl-C\n")
        return "".join(out)

    # -- chart ------------------------------------------------------------------------------

    def plot(self, path: Path) -> None:
        """Bars of decode tok/s (± stddev) and peak RSS per configuration, as an image."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise InvalidRequestError(plot_missing_message()) from exc
        rows = self.measured()
        if not rows:
            return
        engines = list(dict.fromkeys(r.engine for r in rows))
        palette = ["#3b7dd8", "#d8873b", "#4aa35a", "#a34a9b", "#7f7f7f"]
        colors = [palette[engines.index(r.engine) % len(palette)] for r in rows]
        labels = [f"{r.model[:28]} pp{r.prompt_tokens} t{r.threads}" for r in rows]
        tg = [r.figure("tg_tok_s") for r in rows]
        rss = [r.figure("peak_rss_mb")["max"] for r in rows]
        plans = [(r.last("plan_total_bytes") or 0) / MB for r in rows]
        width = max(6.0, min(0.45 * len(rows) + 2.0, 20.0))
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(width, 9.0), sharex=True)
        xs = list(range(len(rows)))
        ax1.bar(
            xs, [t["mean"] for t in tg], yerr=[t["stddev"] for t in tg], capsize=2, color=colors
        )
        ax1.set_ylabel("decode tokens/s (mean ± stddev)")
        ax1.set_title(f"edgeinfer bench: {self.settings['new_tokens']} generated tokens")
        ax1.legend(
            handles=[
                plt.Rectangle((0, 0), 1, 1, color=palette[i % len(palette)])
                for i in range(len(engines))
            ],
            labels=engines,
            loc="best",
            fontsize="small",
        )
        ax2.bar(xs, rss, color=colors)
        if any(plans):
            ax2.scatter(
                xs,
                [p or math.nan for p in plans],
                color="black",
                marker="_",
                s=200,
                label="edgeinfer's memory plan",
            )
            ax2.legend(loc="best", fontsize="small")
        ax2.set_ylabel("peak RSS, MB")
        ax2.set_xticks(xs)
        ax2.set_xticklabels(labels, rotation=60, ha="right", fontsize="small")
        fig.tight_layout()
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
        os.close(fd)
        try:
            fig.savefig(tmp, dpi=110)
            os.replace(tmp, path)
        finally:
            plt.close(fig)
            if os.path.exists(tmp):
                os.unlink(tmp)


def plot_missing_message() -> str:
    return (
        "--plot needs matplotlib, which is not installed: pip install 'edgeinfer[bench]' "
        "(or pip install matplotlib)"
    )


def _pm(s: dict[str, float], digits: int) -> str:
    return f"{s['mean']:.{digits}f} ± {s['stddev']:.{digits}f}"
