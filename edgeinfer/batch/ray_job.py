"""The batch job on a Ray cluster (``edgeinfer[ray]``): Ray Data carries the rows to actors
that each hold one model, and the records come back to this process, which appends them to
the output in input order exactly as the local job does.

The rows are read and checked here (the same bounds, duplicate ids and resume as the local
job); the actors run them with the function the local job uses (:func:`run_row`), each with
up to two requests per sequence slot in flight. Every worker loads the model itself: a
catalog name from its own ``$EDGEINFER_HOME`` (fetched there if missing), or a path that all
workers see (a shared folder). Ctrl-C stops the job; the output resumes. The output is
locked for the job's life, and Ray's own refusals (an address it cannot reach, a worker that
cannot load the model) are one BackendUnavailableError that says what to check.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..errors import BackendUnavailableError, EdgeInferError
from ..generation.sampling import SamplingConfig
from .files import read_rows
from .job import BatchSummary, Plan, RowWarnings, check_paths, run_rows
from .meter import Meter
from .output import OutputFile, recover
from .records import Row, encode_record

__all__ = ["RowActor", "run_ray_batch"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_ROWS_PER_CALL = 4  # rows per map_batches call, per request the actor keeps in flight


class RowActor:
    """A Ray actor holding one model; maps a batch of pickled rows to their output lines."""

    def __init__(
        self,
        model: str,
        load_options: Mapping[str, Any],
        chat_template: str | None = None,
    ) -> None:
        from ..loader import load

        logging.getLogger("edgeinfer.generation.results").addFilter(
            RowWarnings()
        )  # run_row names rows
        self._model = load(model, **dict(load_options))
        if chat_template is not None:
            self._model.use_chat_template(chat_template)
        self._window = 2 * int(getattr(self._model, "parallel", 1))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = [pickle.loads(blob) for blob in batch["row"]]  # pickled by our own driver
        records = run_rows(self._model, rows, self._window)
        return {
            "i": batch["i"],
            "line": np.array([encode_record(r).decode("utf-8") for r in records], dtype=object),
            "tokens": np.array([(r["usage"] or {}).get("completion_tokens", 0) for r in records]),
            "failed": np.array([r["error"] is not None for r in records]),
        }


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailableError(
            "edgeinfer batch --ray needs Ray Data: pip install 'edgeinfer[ray]'"
        ) from exc
    return ray


def run_ray_batch(
    model: str | os.PathLike[str],
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    address: str | None = None,
    actors: int = 1,
    load_options: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
    config: SamplingConfig | None = None,
    progress: bool = True,
    **sampling: Any,
) -> BatchSummary:
    """``run_batch`` on Ray: ``actors`` actors, each loading ``model`` with
    ``load_options`` (``parallel=N`` among them). Uses the Ray this process is connected to,
    or connects to ``address`` (None: a local Ray, or $RAY_ADDRESS) and disconnects after."""
    src = Path(in_path)
    dst = check_paths(src, out_path)
    base = SamplingConfig.from_kwargs(config, **sampling)
    with OutputFile(dst) as out:  # locked: a second job on it is refused
        plan = Plan(recover(dst))
        rows = list(plan.pending(read_rows(src, base)))
        meter = Meter(len(rows), enabled=progress)
        ray = _ray()
        started = bool(rows) and not ray.is_initialized()
        if started:
            _start_ray(ray, address)
        try:
            options = dict(load_options or {})
            with meter.showing():
                batches = _dataset(ray, rows, str(model), actors, options, chat_template)
                for lines, tokens, failed in _ray_errors(ray, _in_order(batches), meter):
                    out.append(lines)
                    meter.add(len(lines), tokens, failed)
        finally:
            if started:
                ray.shutdown()
    return BatchSummary(dst, meter.rows, meter.errors, plan.skipped, meter.tokens, meter.seconds)


def _start_ray(ray: Any, address: str | None) -> None:
    """``ray.init``, whose many refusals (an address it cannot reach or parse, a cluster of
    another version) become one error naming the fix."""
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except Exception as exc:  # Ray raises ConnectionError, ValueError, RuntimeError...
        where = f"at {address}" if address else "(a local one, or $RAY_ADDRESS)"
        raise BackendUnavailableError(
            f"Ray did not start {where}: {_first_line(exc)}; check --ray ADDRESS (or "
            "$RAY_ADDRESS and the cluster), or run without --ray"
        ) from exc


def _ray_errors(ray: Any, items: Iterator[_T], meter: Meter) -> Iterator[_T]:
    """``items``, with a failure inside Ray (a worker that cannot load the model, a lost
    actor) as one error; the records written before it are kept."""
    try:
        yield from items
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None)
        reason = str(cause) if isinstance(cause, EdgeInferError) else _first_line(exc)
        raise BackendUnavailableError(
            f"the Ray job failed: {reason}; the {meter.rows} records written are kept: fix "
            "that and run the same command again to resume"
        ) from exc


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else 'no reason given'}"[:300]


def _dataset(
    ray: Any,
    rows: list[Row],
    model: str,
    actors: int,
    options: dict[str, Any],
    chat_template: str | None,
) -> Iterator[dict[str, np.ndarray]]:
    """The records' batches as Ray Data makes them (in order, but _in_order does not rely
    on it)."""
    if not rows:
        return iter(())
    parallel = options.get("parallel", 1)
    per_call = _ROWS_PER_CALL * 2 * (parallel if isinstance(parallel, int) else 8)
    items = [{"i": i, "row": pickle.dumps(row)} for i, row in enumerate(rows)]
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # the job draws its own
    dataset = ray.data.from_items(items).map_batches(
        RowActor,
        fn_constructor_kwargs={
            "model": model,
            "load_options": options,
            "chat_template": chat_template,
        },
        batch_size=per_call,
        batch_format="numpy",
        concurrency=actors,
    )
    return iter(dataset.iter_batches(batch_size=None, batch_format="numpy"))


def _in_order(
    batches: Iterator[dict[str, np.ndarray]],
) -> Iterator[tuple[list[bytes], int, int]]:
    """(lines, completion tokens, error records) of each run of rows that is next in order."""
    pending: dict[int, tuple[str, int, bool]] = {}
    following = 0
    for batch in batches:
        for i, line, tokens, failed in zip(
            batch["i"], batch["line"], batch["tokens"], batch["failed"], strict=True
        ):
            pending[int(i)] = (str(line), int(tokens), bool(failed))
        ready = []
        while following in pending:
            ready.append(pending.pop(following))
            following += 1
        if ready:
            yield (
                [line.encode("utf-8") for line, _, _ in ready],
                sum(t for _, t, _ in ready),
                sum(f for _, _, f in ready),
            )
