"""Embeddings: edgeinfer against sentence-transformers on the same weights, in the same run.

- fidelity: cosine similarity of each text's vector to sentence-transformers' (torch) on a
  multilingual set (ASCII, accents, CJK, emoji, a text past the maximum length), and the
  lowest cosine over the throughput workload, for edgeinfer and for sentence-transformers'
  ONNX backend;
- throughput: 256 short support tickets, batch 32, 2 threads, texts/s of ``model.embed``
  against ``SentenceTransformer.encode`` on torch (CPU) and with ``backend="onnx"`` (its
  optimum export, made once per run). One subprocess per engine run, engines interleaved
  (A B C C B A ...), one warm-up pass and 5 measured passes each; medians and ranges, and
  the ratio within each round (robust to a load that drifts between rounds);
- the GGUF route (``edgeinfer-gguf``): the same weights converted once to a float32 BERT GGUF
  (``edgeinfer.embedding.gguf.derived_encoder_gguf``) run in llama.cpp's embedding mode,
  when llama-cpp-python and gguf are installed. Each engine's lowest cosine to
  sentence-transformers (torch) stands beside its rate in the summary.

    python benchmarks/embeddings.py [--rounds 4] [--threads 2] [--out FILE.json]

Needs sentence-transformers (and optimum for the ONNX backend; it is skipped without).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.bench.embed import tickets  # the workload edgeinfer bench measures too

MODEL = "all-minilm-l6-v2"
BATCH = 32
PASSES = 5

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password?",
    "Ça coûte cinq euros, señor; naïve café à Zürich.",
    "Größenordnung und Übermaß: Straße.",
    "机器学习是人工智能的一个分支。",
    "東京は日本の首都です。",
    "한국어 문장도 처리할 수 있나요?",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "I love this! 🎉🚀😀👍🏽",
    "🤖🤖🤖",
    "",
    "long " + "a very long document about nothing in particular, " * 200,
]

# -- workers (one per subprocess) ------------------------------------------------------------


def gguf_path() -> Path:
    """The catalog model's folder as a GGUF, converted once into $EDGEINFER_HOME/derived."""
    from edgeinfer.embedding.gguf import derived_encoder_gguf
    from edgeinfer.files import catalog
    from edgeinfer.files.encoder_folder import read_encoder_folder

    return derived_encoder_gguf(MODEL, read_encoder_folder(catalog.fetch(MODEL)))


def _encoder(engine: str, threads: int, st_onnx: str | None) -> Any:
    if engine in ("edgeinfer", "edgeinfer-gguf"):
        import edgeinfer

        source = gguf_path() if engine == "edgeinfer-gguf" else MODEL
        model = edgeinfer.load(source, threads=threads)
        return lambda texts: model.embed(texts, batch_size=BATCH)
    import torch

    torch.set_num_threads(threads)
    from sentence_transformers import SentenceTransformer

    from edgeinfer.files import catalog

    folder = str(catalog.fetch(MODEL))
    kwargs: dict[str, Any] = {}
    if engine == "st-onnx":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        folder = st_onnx or folder
        kwargs = {"backend": "onnx", "model_kwargs": {"session_options": options}}
    st = SentenceTransformer(folder, device="cpu", **kwargs)
    return lambda texts: st.encode(
        texts, batch_size=BATCH, normalize_embeddings=True, convert_to_numpy=True
    )


def worker(engine: str, threads: int, out: Path, st_onnx: str | None) -> None:
    encode = _encoder(engine, threads, st_onnx)
    work = tickets()
    encode(work)  # warm-up
    seconds = []
    for _ in range(PASSES):
        start = time.perf_counter()
        vectors = encode(work)
        seconds.append(time.perf_counter() - start)
    np.save(out.with_suffix(".tickets.npy"), np.asarray(vectors, np.float32))
    np.save(out.with_suffix(".multi.npy"), np.asarray(encode(MULTILINGUAL), np.float32))
    out.write_text(json.dumps({"engine": engine, "seconds": seconds, "texts": len(work)}))


def export_st_onnx(dest: Path) -> None:
    """sentence-transformers' own ONNX export (optimum), saved once for the run."""
    from sentence_transformers import SentenceTransformer

    from edgeinfer.files import catalog

    st = SentenceTransformer(str(catalog.fetch(MODEL)), device="cpu", backend="onnx")
    st.save_pretrained(str(dest))


# -- the parent ------------------------------------------------------------------------------


def _run(args: list[str], threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true"}
    subprocess.run([sys.executable, __file__, *args], check=True, env=env)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/embeddings.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--st-onnx", help=argparse.SUPPRESS)
    parser.add_argument("--export", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.export:
        return export_st_onnx(Path(args.export))
    if args.worker:
        return worker(args.worker, args.threads, Path(args.result), args.st_onnx)
    engines = ["edgeinfer", "st-torch"] + (["st-onnx"] if _has("optimum") else [])
    if _has("llama_cpp") and _has("gguf"):
        engines.append("edgeinfer-gguf")
        gguf_path()  # converted before any timing
    with tempfile.TemporaryDirectory() as tmp:
        st_onnx = Path(tmp) / "st-onnx"
        if "st-onnx" in engines:
            _run(["--export", str(st_onnx)], args.threads)
        load_before = os.getloadavg()
        runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        vectors: dict[str, dict[str, np.ndarray]] = {}
        for r in range(args.rounds):
            # A B C, then C B A: a machine whose load drifts favours no engine
            for engine in engines if r % 2 == 0 else engines[::-1]:
                result = Path(tmp) / f"{engine}-{r}.json"
                _run(
                    ["--worker", engine, "--threads", str(args.threads), "--result", str(result),
                     "--st-onnx", str(st_onnx)],
                    args.threads,
                )  # fmt: skip
                runs[engine].append(json.loads(result.read_text()))
                vectors[engine] = {
                    kind: np.load(result.with_suffix(f".{kind}.npy"))
                    for kind in ("tickets", "multi")
                }
        report = _report(engines, runs, vectors, args, load_before)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(report["summary"], indent=1))


def _cosines(a: np.ndarray, b: np.ndarray) -> list[float]:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return [round(float(x), 7) for x in (a * b).sum(1)]


def _rate(run: dict[str, Any]) -> float:
    return float(run["texts"] / statistics.median(run["seconds"]))


def _report(
    engines: list[str],
    runs: dict[str, list[dict[str, Any]]],
    vectors: dict[str, dict[str, np.ndarray]],
    args: argparse.Namespace,
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    rates = {e: [run["texts"] / s for run in runs[e] for s in run["seconds"]] for e in engines}
    median = {e: statistics.median(v) for e, v in rates.items()}
    fidelity = {
        e: {
            "multilingual_cosine_to_st_torch": dict(
                zip(
                    [t[:40] for t in MULTILINGUAL],
                    _cosines(vectors[e]["multi"], vectors["st-torch"]["multi"]),
                    strict=True,
                )
            ),
            "tickets_min_cosine_to_st_torch": min(
                _cosines(vectors[e]["tickets"], vectors["st-torch"]["tickets"])
            ),
        }
        for e in engines
        if e != "st-torch"
    }
    summary = {
        "texts_per_s_median": {e: round(v, 1) for e, v in median.items()},
        "texts_per_s_range": {e: [round(min(v), 1), round(max(v), 1)] for e, v in rates.items()},
        "min_cosine_to_st_torch": {
            e: min(
                min(f["multilingual_cosine_to_st_torch"].values()),
                f["tickets_min_cosine_to_st_torch"],
            )
            for e, f in fidelity.items()
        },
        "edgeinfer_vs": {e: round(median["edgeinfer"] / median[e], 3) for e in engines[1:]},
        "edgeinfer_vs_per_round": {
            e: [
                round(_rate(a) / _rate(b), 3)
                for a, b in zip(runs["edgeinfer"], runs[e], strict=True)
            ]
            for e in engines[1:]
        },
        "targets": {"st-torch": 1.5, "st-onnx": 1.2},
        "edgeinfer_min_cosine": min(
            min(fidelity["edgeinfer"]["multilingual_cosine_to_st_torch"].values()),
            fidelity["edgeinfer"]["tickets_min_cosine_to_st_torch"],
        ),
    }
    return {
        "benchmark": "embeddings",
        "command": " ".join(["python", *sys.argv]),
        "model": MODEL,
        "workload": {
            "texts": len(tickets()),
            "batch": BATCH,
            "threads": args.threads,
            "passes": PASSES,
            "rounds": args.rounds,
        },
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "versions": {
            p: _version(p)
            for p in (
                "edgeinfer",
                "onnxruntime",
                "sentence-transformers",
                "torch",
                "optimum",
                "llama-cpp-python",
            )
        },
        "summary": summary,
        "fidelity": fidelity,
        "runs": runs,
    }


if __name__ == "__main__":
    main()
