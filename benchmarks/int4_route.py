"""The lossy int4 route against onnxruntime-genai's int4 graph, both from the same float source.

The default model ships only as a Q4_1 GGUF, so the float source is that file dequantized to
F32 (``converters/sources/gguf_float.py``, cached under ``$EDGEINFER_HOME/derived``): the
source is itself dequantized Q4_1, not the original checkpoint. From it:

- ``int4-search-head8``: ``--quant int4 --head-8bit`` (symmetric 4-bit blocks of 32 with
  searched scales, embedding and tied output projection at 8 bits);
- ``int4-search``: the same with the embedding and output projection at 4 bits;
- ``int4-rtn-head8``: the previous quantizer (round-to-nearest) with 8-bit head, for the gain;
- ``exact``: the Q4_1 GGUF's own blocks transcoded (the default route);
- ``ortgenai-int4``: onnxruntime-genai's builder's int4 CPU graph (``-p int4 -e cpu``) of the
  Hugging Face folder transformers dequantized from the same GGUF (the same float values:
  the script checks the FFN tensors, which no layout change touches, against the F32 GGUF).

Fidelity: teacher-forced over fixed texts, each graph's next-token logits against llama.cpp
on the F32 source: top-1 agreement, mean KL(reference || graph), and greedy decoding from each
prompt: tokens before the first divergence. Speed: decode tok/s of a bare IO-binding loop
(128-token prompt, 128 steps) in a fresh process per measurement, the graphs interleaved
(A B C ... A B C), medians over the rounds, the load average beside each measurement.

    python benchmarks/int4_route.py [--rounds 5] [--threads 2] [--genai FOLDER]
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).parent))
from bench_native_onnx import Loop, _session  # the same bare decode loop

OUT = Path(__file__).parent / "results" / "int4_route.json"
TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type with an oil-based ink and a screw press.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])",
    "Photosynthesis converts light energy into chemical energy. Plants take in carbon "
    "dioxide and water and, using sunlight, produce glucose and oxygen.",
    "Q: What is the capital of France?\nA: Paris.\nQ: What is 12 times 12?\nA: 144.\n"
    "Q: Who wrote Hamlet?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley.",
)
GREEDY_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three uses of copper:",
    "In 1969, the first humans",
)
GREEDY_TOKENS = 32


def _decode_one(folder: Path, threads: int) -> dict[str, float]:
    """One measurement (run in its own process): 128-token prompt, 128 decode steps."""
    loop = Loop(_session(folder, threads), 1024)
    t0 = time.perf_counter()
    logits = loop(list(range(1000, 1128)))
    t1 = time.perf_counter()
    stamps = []
    for _ in range(128):
        logits = loop([int(np.argmax(logits))])
        stamps.append(time.perf_counter())
    return {"ttft_ms": (t1 - t0) * 1000, "decode_tok_s": 127 / (stamps[-1] - stamps[0])}


def _reference(source: Path, threads: int) -> tuple[list[list[int]], list[Any], list[list[int]]]:
    """Token ids of the texts, llama.cpp's teacher-forced logits on them, and its greedy
    continuations of the prompts, all on the float source."""
    import edgeinfer

    with edgeinfer.load(source, context_length=512, threads=threads) as model:
        backend = model._backend
        ids = [model.tokenize(text) for text in TEXTS]
        logits = []
        for seq in ids:
            backend.rewind(0)
            rows = [np.array(backend.prefill(seq[:1]), np.float32)]
            rows += [np.array(backend.decode(t), np.float32) for t in seq[1:]]
            logits.append(np.stack(rows))
        greedy = []
        for prompt in GREEDY_PROMPTS:
            backend.rewind(0)
            seq = model.tokenize(prompt)
            row = np.array(backend.prefill(seq), np.float32)
            out = []
            for _ in range(GREEDY_TOKENS):
                out.append(int(np.argmax(row)))
                row = np.array(backend.decode(out[-1]), np.float32)
            greedy.append(seq + out)
    return ids, logits, greedy


def _kl(ref: np.ndarray, got: np.ndarray) -> float:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    p, q = log_softmax(ref), log_softmax(got)
    return float((np.exp(p) * (p - q)).sum(axis=-1).mean())


def _fidelity(folder: Path, threads: int, reference: tuple[Any, Any, Any]) -> dict[str, Any]:
    ids, logits, greedy = reference
    session = _session(folder, threads)
    same, kls = [], []
    for seq, ref in zip(ids, logits, strict=True):
        loop = Loop(session, 512)
        rows = np.stack([loop(seq[:1])] + [loop([t]) for t in seq[1:]])
        same += list(rows.argmax(axis=-1) == ref.argmax(axis=-1))
        kls.append(_kl(ref, rows))
    prefixes = []
    for full in greedy:
        prompt = len(full) - GREEDY_TOKENS
        loop = Loop(session, 512)
        row = loop(full[:prompt])
        n = 0
        while n < GREEDY_TOKENS and int(np.argmax(row)) == full[prompt + n]:
            row = loop([full[prompt + n]])
            n += 1
        prefixes.append(n)
    return {
        "tokens": len(same),
        "top1_agreement": round(float(np.mean(same)), 4),
        "mean_kl": round(float(np.mean(kls)), 5),
        "greedy_prefix": prefixes,
        "greedy_prefix_mean": round(float(np.mean(prefixes)), 2),
    }


def _quantize_time(source: Path) -> dict[str, Any]:
    """CPU seconds of the searched quantizer on the largest tensor (the embedding)."""
    from edgeinfer.converters.onnx.builder.tensors import GGUFTensors
    from edgeinfer.converters.onnx.quantize import quantize_searched
    from edgeinfer.files.gguf_file import read_gguf_header

    tensors = GGUFTensors(read_gguf_header(source), lambda: None)
    t = tensors.info("token_embd.weight")
    assert t is not None
    w = tensors.floats(t)
    cpu, wall = time.process_time(), time.perf_counter()
    quantize_searched(w, 4)
    return {
        "tensor": "token_embd.weight",
        "weights": int(w.size),
        "cpu_s": round(time.process_time() - cpu, 1),
        "wall_s": round(time.perf_counter() - wall, 1),
    }


def _build(source: Path, exact_src: Path, root: Path) -> dict[str, dict[str, Any]]:
    """The edgeinfer folders, each with its build time and block counts."""
    from edgeinfer.converters.onnx import quantize
    from edgeinfer.converters.onnx.builder import linear
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    def rtn(w: np.ndarray, bits: int) -> Any:
        q = quantize.quantize_rtn(w, bits)
        n, k = w.shape
        return linear.NBitsWeight(n, k, q.bits, q.block_size, q.packed(), q.scales, None)

    plans = {
        "int4-search-head8": (source, "int4", 8, None),
        "int4-search": (source, "int4", None, None),
        "int4-rtn-head8": (source, "int4", 8, rtn),
        "exact": (exact_src, "keep", None, None),
    }
    built = {}
    for name, (src, quant, head_bits, requantize) in plans.items():
        folder = root / name
        if (folder / "edgeinfer.json").is_file():  # --keep: built by an earlier run
            nbits = json.loads((folder / "edgeinfer.json").read_text())["quantization"]["nbits"]
            data = (folder / "model.onnx.data").stat().st_size
            built[name] = {"folder": folder, "build_s": None, "nbits": nbits}
            built[name]["data_mb"] = round(data / 1e6, 1)
            continue
        folder.mkdir()
        saved = linear.requantize
        if requantize is not None:  # the previous quantizer, for its figures only
            linear.requantize = requantize
            sys.modules["edgeinfer.converters.onnx.builder.parts"].requantize = requantize
        try:
            t0 = time.perf_counter()
            _, report = write_gguf_folder(
                src, folder, quant=quant, head_bits=head_bits, max_context=1024
            )
            seconds = time.perf_counter() - t0
            print(f"built {name} in {seconds:.0f} s", flush=True)
        finally:
            linear.requantize = saved
            sys.modules["edgeinfer.converters.onnx.builder.parts"].requantize = saved
        data = (folder / "model.onnx.data").stat().st_size
        built[name] = {"folder": folder, "build_s": round(seconds, 1), "nbits": report.nbits}
        built[name]["data_mb"] = round(data / 1e6, 1)
    return built


def _same_floats(source: Path, hf: Path) -> dict[str, float]:
    """The largest difference between the F32 GGUF's FFN weights and the HF folder's."""
    from safetensors.numpy import load_file

    from edgeinfer.converters.onnx.builder.tensors import GGUFTensors
    from edgeinfer.files.gguf_file import read_gguf_header

    header = read_gguf_header(source)
    tensors = GGUFTensors(header, lambda: None)
    hf_weights = load_file(str(hf / "model.safetensors"))
    worst = 0.0
    for layer in (0, 15, 29):
        for ours, theirs in (("ffn_down", "down_proj"), ("ffn_gate", "gate_proj")):
            t = tensors.info(f"blk.{layer}.{ours}.weight")
            assert t is not None
            a = tensors.floats(t)
            b = hf_weights[f"model.layers.{layer}.mlp.{theirs}.weight"].astype(np.float32)
            worst = max(worst, float(np.abs(a - b).max()))
    return {"ffn_max_abs_diff": worst}


def _speed(folders: dict[str, Path], rounds: int, threads: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in folders}
    names = list(folders)
    for r in range(rounds + 1):  # round 0 warms the page cache and is not counted
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            load = os.getloadavg()[0]
            out = subprocess.run(
                [sys.executable, __file__, "--decode", str(folders[name]), "-t", str(threads)],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout)
            row["load1"] = round(load, 2)
            if r:
                runs[name].append(row)
            tok_s = row["decode_tok_s"]
            print(f"round {r} {name:20s} {tok_s:7.1f} tok/s load {load:.1f}", flush=True)
    return {
        name: {
            "decode_tok_s_median": round(statistics.median(x["decode_tok_s"] for x in rows), 1),
            "ttft_ms_median": round(statistics.median(x["ttft_ms"] for x in rows), 1),
            "runs": rows,
        }
        for name, rows in runs.items()
    }


def _ratios(speed: dict[str, Any], peer: str) -> dict[str, Any]:
    """Each graph's decode against the peer's, per round (same round, adjacent in time)."""
    out = {}
    for name, row in speed.items():
        if name == peer:
            continue
        pairs = zip(row["runs"], speed[peer]["runs"], strict=True)
        per_round = [round(a["decode_tok_s"] / b["decode_tok_s"], 3) for a, b in pairs]
        out[f"{name} / {peer}"] = {"median": statistics.median(per_round), "rounds": per_round}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--genai", type=Path, help="onnxruntime-genai's int4 folder")
    parser.add_argument(
        "--keep", type=Path, help="build the folders here and reuse them on the next run"
    )
    parser.add_argument("--decode", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.decode is not None:
        print(json.dumps(_decode_one(args.decode, args.threads)))
        return 0
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    import onnxruntime

    from edgeinfer.converters.sources.gguf_float import cached_float_gguf
    from edgeinfer.files import catalog

    gguf = catalog.fetch(catalog.DEFAULT_MODEL)
    derived = gguf_derived()
    genai = args.genai or derived / "ortgenai-int4-cpu"
    if not (genai / "model.onnx").is_file():
        raise SystemExit(
            f"{genai}: no onnxruntime-genai folder; build one in its own environment: "
            f"python -m onnxruntime_genai.models.builder -i {derived}/hf -o {genai} -p int4 -e cpu"
        )
    t0 = time.perf_counter()
    source = cached_float_gguf(gguf)
    print(f"float source: {source}", flush=True)
    report: dict[str, Any] = {
        "model": catalog.DEFAULT_MODEL,
        "float_source": {"path": str(source), "made_s": round(time.perf_counter() - t0, 1)},
        "threads": args.threads,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "onnxruntime": onnxruntime.__version__,
        "load_at_start": os.getloadavg(),
    }
    if (derived / "hf" / "model.safetensors").is_file():
        report["float_source"]["vs_genai_source"] = _same_floats(source, derived / "hf")
    report["quantize_embedding"] = _quantize_time(source)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) if args.keep is None else args.keep
        root.mkdir(parents=True, exist_ok=True)
        built = _build(source, gguf, root)
        folders = {name: row.pop("folder") for name, row in built.items()}
        folders["ortgenai-int4"] = genai
        report["built"] = built
        # fidelity runs on one thread: llama.cpp's (and onnxruntime's) spinning worker threads
        # crawl on an oversubscribed machine, and the figures do not depend on the count
        reference = _reference(source, 1)
        report["fidelity"] = {}
        for name, folder in folders.items():
            report["fidelity"][name] = _fidelity(folder, 1, reference)
            print(name, json.dumps(report["fidelity"][name]), flush=True)
        _write(args.out, report)  # the fidelity figures stand even if the timing is cut short
        # the previous quantizer's graph has the same operators as the searched one: not timed
        timed = {k: v for k, v in folders.items() if k != "int4-rtn-head8"}
        report["speed"] = _speed(timed, args.rounds, args.threads)
    report["decode_ratio"] = _ratios(report["speed"], "ortgenai-int4")
    report["load_at_end"] = os.getloadavg()
    _write(args.out, report)
    print(json.dumps(report["decode_ratio"], indent=1))
    return 0


def _write(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


def gguf_derived() -> Path:
    """Where the tests keep the default model's conversions (the genai folder among them)."""
    from edgeinfer.files import catalog

    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    assert entry.sha256 is not None
    return catalog.edgeinfer_home() / "derived" / f"{entry.sha256[:16]}-r2"


if __name__ == "__main__":
    sys.exit(main())
