"""``edgeinfer bench`` for embedding models: texts/s at batch 32 on 256 short support tickets,
each engine in its own process, engines interleaved round by round (A B C, then C B A), one
warm-up pass and ``-r`` measured passes per run; each row carries the lowest cosine of its
vectors to the reference's (sentence-transformers on torch when it is installed and the
model is a folder, else the first row) on the same texts, in the same run.

Rows: each MODEL through edgeinfer (an encoder folder or catalog name on the ONNX encoder; an
embedding GGUF in llama.cpp's embedding mode); with ``--compare``, sentence-transformers on
torch and with its ONNX backend (``backend="onnx"``) on each folder MODEL, when installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidRequestError

__all__ = ["BATCH", "is_embedding_model", "run_embed_bench", "tickets"]

BATCH = 32
_ITEMS = ["printer", "laptop", "router", "phone app", "account", "email", "VPN", "invoice"]
_ISSUES = [
    "stopped working after the last update",
    "shows error code {n} when I try to log in",
    "is very slow since this morning and the whole team is blocked",
    "was charged twice",
    "does not sync",
    "keeps disconnecting every few minutes, even after a restart and a reinstall",
]


def tickets(n: int = 256) -> list[str]:
    """Deterministic short support tickets of varied length."""
    out = []
    for i in range(n):
        issue = _ISSUES[i % len(_ISSUES)].format(n=100 + i % 37)
        tail = " Please help, it is urgent." if i % 3 == 0 else ""
        out.append(f"Ticket #{1000 + i}: my {_ITEMS[i % len(_ITEMS)]} {issue}.{tail}")
    return out


def is_embedding_model(model: str) -> bool:
    """Whether ``model`` (a catalog name, a folder or a file) is an embedding model; a name
    that resolves to nothing is not (the generation bench reports it)."""
    from ..files import catalog

    entry = catalog.lookup(model)
    if entry is not None:
        return getattr(entry, "kind", "generation") == "embedding"
    from ..embedding.gguf import is_embedding_gguf
    from ..errors import EdgeInferError
    from ..files.source import resolve

    try:
        source = resolve(model)
    except (EdgeInferError, OSError, ValueError):  # the generation bench says what is wrong
        return False
    return source.format == "encoder" or (
        source.format == "gguf" and is_embedding_gguf(source.header)
    )


def _folder(model: str) -> Path | None:
    """The sentence-transformers folder of ``model`` (None for a GGUF)."""
    from ..files import catalog

    entry = catalog.lookup(model)
    path = catalog.fetch(model) if entry is not None else Path(model)
    return path if path.is_dir() else None


def _rows(models: list[str], compare: bool) -> list[tuple[str, str]]:
    """(engine, model) rows: edgeinfer on each model, then the installed peers on folders."""
    rows = [("edgeinfer", m) for m in models]
    if compare and importlib.util.find_spec("sentence_transformers") is not None:
        for m in models:
            if _folder(m) is not None:
                rows.append(("st-torch", m))
                if importlib.util.find_spec("optimum") is not None:
                    rows.append(("st-onnx", m))
    return rows


def _encoder(engine: str, model: str, threads: int) -> Any:
    if engine == "edgeinfer":
        import edgeinfer

        loaded = edgeinfer.load(model, threads=threads)
        return lambda texts: loaded.embed(texts, batch_size=BATCH)
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    kwargs: dict[str, Any] = {}
    if engine == "st-onnx":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        kwargs = {"backend": "onnx", "model_kwargs": {"session_options": options}}
    st = SentenceTransformer(str(_folder(model)), device="cpu", **kwargs)
    return lambda texts: st.encode(texts, batch_size=BATCH, normalize_embeddings=True)


def worker(engine: str, model: str, threads: int, passes: int, warmup: int, out: Path) -> None:
    """One run (in its own process): load, warm up, time ``passes`` passes, save vectors."""
    encode = _encoder(engine, model, threads)
    work = tickets()
    for _ in range(warmup):
        encode(work)
    seconds = []
    vectors = None
    for _ in range(passes):
        start = time.perf_counter()
        vectors = encode(work)
        seconds.append(time.perf_counter() - start)
    np.save(out.with_suffix(".npy"), np.asarray(vectors, np.float32))
    out.write_text(json.dumps({"seconds": seconds, "texts": len(work)}))


def run_embed_bench(
    models: list[str], *, threads: int, passes: int, warmup: int, rounds: int, compare: bool,
    timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Measure every row ``rounds`` times, interleaved; the report as a dict."""
    if passes < 1 or warmup < 0 or rounds < 1:
        raise InvalidRequestError("-r/--repetitions must be >= 1 and --warmup >= 0")
    rows = _rows(models, compare)
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(rows))}
    vectors: dict[int, np.ndarray] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = list(range(len(rows)))
            for i in order if r % 2 == 0 else order[::-1]:
                out = Path(tmp) / f"{i}-{r}.json"
                engine, model = rows[i]
                command = [sys.executable, "-m", "edgeinfer.bench.embed", engine, model,
                           str(threads), str(passes), str(warmup), str(out)]  # fmt: skip
                subprocess.run(command, check=True, timeout=timeout_s)
                runs[i].append(json.loads(out.read_text()))
                vectors[i] = np.load(out.with_suffix(".npy"))
    return _report(rows, runs, vectors, threads, load_before)


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return round(float((a * b).sum(1).min()), 7)


def _report(
    rows: list[tuple[str, str]],
    runs: dict[int, list[dict[str, Any]]],
    vectors: dict[int, np.ndarray],
    threads: int,
    load_before: tuple[float, ...],
) -> dict[str, Any]:
    reference = next((i for i, (e, _) in enumerate(rows) if e == "st-torch"), 0)
    table = []
    for i, (engine, model) in enumerate(rows):
        rates = [run["texts"] / s for run in runs[i] for s in run["seconds"]]
        table.append({
            "engine": engine, "model": model,
            "texts_per_s_median": round(statistics.median(rates), 1),
            "texts_per_s_range": [round(min(rates), 1), round(max(rates), 1)],
            "min_cosine_to_reference": _min_cosine(vectors[i], vectors[reference]),
        })  # fmt: skip
    return {
        "benchmark": "embeddings",
        "workload": {"texts": len(tickets()), "batch": BATCH, "threads": threads},
        "reference": "/".join(rows[reference]),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "rows": table,
    }


def text(report: dict[str, Any], markdown: bool = False) -> str:
    """The report as a table (plain or Markdown)."""
    head = ["engine", "model", "texts/s", "min-max", "cosine to ref"]
    lines = [[r["engine"], r["model"], f"{r['texts_per_s_median']:.1f}",
              "{:.1f}-{:.1f}".format(*r["texts_per_s_range"]),
              f"{r['min_cosine_to_reference']:.7f}"] for r in report["rows"]]  # fmt: skip
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=False)]
        out = ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True))
               for line in [head, *lines]]  # fmt: skip
    w, load = report["workload"], report["load_average"]["before"][0]
    note = (f"{w['texts']} texts, batch {w['batch']}, {w['threads']} threads; reference "
            f"{report['reference']}; load average {load:.1f}")  # fmt: skip
    return "\n".join([*out, note]) + "\n"


def cmd_bench_embed(args: argparse.Namespace) -> int:
    """``edgeinfer bench`` when every MODEL is an embedding model."""
    raw = "2" if args.threads is None else str(args.threads)
    if not raw.isdigit() or not 1 <= int(raw) <= 256:
        raise InvalidRequestError(
            f"--threads {raw[:40]!r}: give one thread count from 1 to 256 for embedding models"
        )
    threads = (int(raw),)
    report = run_embed_bench(
        list(args.models), threads=threads[0], passes=args.repetitions, warmup=args.warmup,
        rounds=2, compare=args.compare, timeout_s=args.timeout,
    )  # fmt: skip
    if args.json:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        sys.stdout.write(text(report, markdown=args.markdown))
    return 0


if __name__ == "__main__":  # one run: ENGINE MODEL THREADS PASSES WARMUP OUT
    _e, _m, _t, _p, _w, _o = sys.argv[1:7]
    worker(_e, _m, int(_t), int(_p), int(_w), Path(_o))
