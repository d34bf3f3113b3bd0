"""The bench's chart: decode tok/s and peak RSS per configuration, one bar each."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError

# a row is the report's Row (model, model_path, engine, engine_model, threads, figures);
# not imported here, so that the report can import this module
Row = Any

__all__ = ["figure", "plot_missing_message", "pyplot", "save"]

MB = 1e6  # as the report's tables count

# one colour per engine and thread count; the plan's marks take a colour no bar has
_PALETTE = ["#3b7dd8", "#d8873b", "#4aa35a", "#a34a9b", "#7f7f7f", "#17becf", "#bcbd22", "#8c564b"]
_PLAN_COLOR = "#d62728"


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InvalidRequestError(plot_missing_message()) from exc
    return plt


def figure(plt: Any, rows: list[Row], new_tokens: int) -> Any:
    """Decode tok/s above, peak RSS (and edgeinfer's plan) below, one bar per row; one
    colour per engine and thread count, the legends outside the bars."""
    kinds = list(dict.fromkeys(_kind(r) for r in rows))
    colors = [_PALETTE[kinds.index(_kind(r)) % len(_PALETTE)] for r in rows]
    width = max(7.0, min(0.45 * len(rows) + 4.0, 22.0))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(width, 9.0), sharex=True)
    xs = list(range(len(rows)))
    tg = [r.figure("tg_tok_s") for r in rows]
    ax1.bar(xs, [t["mean"] for t in tg], yerr=[t["stddev"] for t in tg], capsize=2, color=colors)
    ax1.set_ylabel("decode tokens/s (mean ± stddev)")
    ax1.set_title(f"edgeinfer bench: {new_tokens} generated tokens")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=_PALETTE[i % len(_PALETTE)]) for i in range(len(kinds))
    ]
    ax1.legend(handles=handles, labels=kinds, loc="upper left", bbox_to_anchor=(1.01, 1.0),
               fontsize="small")  # fmt: skip
    _memory_bars(ax2, xs, rows, colors)
    fig.tight_layout()
    return fig


def _kind(r: Row) -> str:
    return f"{r.engine}, {r.threads} thread{'s' if r.threads != 1 else ''}"


def _memory_bars(ax: Any, xs: list[int], rows: list[Row], colors: list[str]) -> None:
    ax.bar(xs, [r.figure("peak_rss_mb")["max"] for r in rows], color=colors)
    plans = [(r.last("plan_total_bytes") or 0) / MB for r in rows]
    marked = [(x, p) for x, p in zip(xs, plans, strict=True) if p]
    if marked:  # a thick line across the bar it belongs to, in a colour no bar has
        ax.hlines([p for _, p in marked], [x - 0.45 for x, _ in marked],
                  [x + 0.45 for x, _ in marked], colors=_PLAN_COLOR, linewidth=3,
                  label="edgeinfer's memory plan")  # fmt: skip
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.set_ylabel("peak RSS, MB")
    ax.set_xticks(xs)
    labels = [f"{_shown_path(r)} pp{r.prompt_tokens} t{r.threads}" for r in rows]
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize="small")


def _shown_path(r: Row) -> str:
    """A catalog name as it is; a file or folder by its last two path parts, so two folders
    named alike (``.../q4/model`` and ``.../int8/model``) stay apart."""
    path = r.engine_model or r.model_path  # a peer's own file or folder where it has one
    if not path or path == r.model or os.sep not in path:
        return r.model[-40:]
    shown = os.path.join(*Path(path).parts[-2:])
    return shown if len(shown) <= 40 else "…" + shown[-39:]


def save(fig: Any, path: Path) -> None:
    """Write the image whole or not at all: a temp file beside it, then a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")  # the legends outside the axes too
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def plot_missing_message() -> str:
    return (
        "--plot needs matplotlib, which is not installed: pip install 'edgeinfer[bench]' "
        "(or pip install matplotlib)"
    )
