"""The native ONNX builder on the default model: agreement with llama.cpp, where a decode
step's time goes, and the graph's raw decode speed.

Builds the default GGUF into a folder with ``write_gguf_folder`` (graph, tokenizer and
manifest from the GGUF alone), then:

- top-1 agreement with llama.cpp on the same GGUF, teacher-forced over a fixed text;
- onnxruntime's profile of 40 decode steps, summed per operator type;
- decode tokens/s of a bare IO-binding loop (no sampler, no detokenizer), 128 steps after a
  128-token prompt.

    python benchmarks/bench_native_onnx.py [--threads 2] [--also FOLDER] [--out FILE.json]

Speed against the peers is ``edgeinfer bench``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _session(folder: Path, threads: int, profile: bool = False) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = str(folder / "profile")
    return ort.InferenceSession(
        str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )


class Loop:
    """The graph driven as the backend drives it: one KV buffer per cache tensor, bound as
    both past and present."""

    def __init__(self, session: Any, context: int, head_dim: int = 64) -> None:
        import onnxruntime as ort

        self.session = session
        self.binding = session.io_binding()
        for i in session.get_inputs():
            if i.name.startswith("past_key_values"):
                _, heads, _, dim = i.shape
                dim = dim if isinstance(dim, int) else head_dim  # genai: "kv_cache_dim"
                buffer = ort.OrtValue.ortvalue_from_numpy(
                    np.zeros((1, heads, context, dim), np.float32)
                )
                self.binding.bind_ortvalue_input(i.name, buffer)
                self.binding.bind_ortvalue_output(
                    i.name.replace("past_key_values", "present"), buffer
                )
        self.total = 0

    def __call__(self, ids: list[int]) -> np.ndarray:
        self.total += len(ids)
        self.binding.bind_cpu_input("input_ids", np.array([ids], np.int64))
        self.binding.bind_cpu_input("attention_mask", np.ones((1, self.total), np.int64))
        self.binding.bind_output("logits")
        self.session.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[-1].numpy()[0, -1]


def agreement(gguf: Path, folder: Path, threads: int) -> dict[str, float]:
    import edgeinfer
    from edgeinfer.bench.workload import PROMPT_TEXT

    text = PROMPT_TEXT + " Paris is the capital of France; 3 + 4 = 7. Café, naïve, 東京, 🙂."
    with edgeinfer.load(gguf, context_length=512, threads=threads) as model:
        ids = model.tokenize(text)[:160]
        backend = model._backend
        reference = [np.array(backend.prefill(ids[:1]), copy=True)]
        reference += [np.array(backend.decode(t), copy=True) for t in ids[1:]]
    loop = Loop(_session(folder, threads), 512)
    ours = [loop(ids[:1])] + [loop([t]) for t in ids[1:]]
    same = [int(np.argmax(a) == np.argmax(r)) for a, r in zip(ours, reference, strict=True)]
    return {
        "tokens": len(ids),
        "top1_agreement": sum(same) / len(same),
        "max_logit_diff": float(
            max(np.abs(a - r).max() for a, r in zip(ours, reference, strict=True))
        ),
    }


def profile(folder: Path, threads: int, steps: int = 40) -> dict[str, dict[str, float]]:
    session = _session(folder, threads, profile=True)
    loop = Loop(session, 512)
    for t in range(steps):
        loop([1000 + t])
    events = json.loads(Path(session.end_profiling()).read_text())
    micros: collections.Counter[str] = collections.Counter()
    nodes: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            micros[e["args"]["op_name"]] += e["dur"]
            nodes[e["args"]["op_name"]] += 1
    return {
        op: {"ms_per_step": us / steps / 1000, "nodes": nodes[op] // steps}
        for op, us in micros.most_common()
    }


def raw_decode(folder: Path, threads: int) -> dict[str, float]:
    loop = Loop(_session(folder, threads), 1024)
    t0 = time.perf_counter()
    logits = loop(list(range(1000, 1128)))
    t1 = time.perf_counter()
    stamps = []
    for _ in range(128):
        logits = loop([int(np.argmax(logits))])
        stamps.append(time.perf_counter())
    return {"ttft_ms": (t1 - t0) * 1000, "decode_tok_s": 127 / (stamps[-1] - stamps[0])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--also",
        type=Path,
        metavar="FOLDER",
        help="profile another folder of the same model too (onnxruntime-genai's, say)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "native-onnx.json"
    )
    args = parser.parse_args()
    from edgeinfer.converters.onnx.folder import write_gguf_folder
    from edgeinfer.files import catalog

    gguf = catalog.fetch(catalog.DEFAULT_MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        _, built = write_gguf_folder(gguf, folder, max_context=2048)
        report = {
            "build_s": time.perf_counter() - t0,
            "nbits": built.nbits,
            "threads": args.threads,
            "agreement": agreement(gguf, folder, args.threads),
            "raw_loop": raw_decode(folder, args.threads),
            "profile": profile(folder, args.threads),
        }
        if args.also is not None:
            report["also"] = {
                "folder": str(args.also),
                "raw_loop": raw_decode(args.also, args.threads),
                "profile": profile(args.also, args.threads),
            }
    print(json.dumps({k: v for k, v in report.items() if k not in ("profile", "also")}, indent=1))
    profiles = [("native", report["profile"])]
    if "also" in report:
        print("also:", json.dumps(report["also"]["raw_loop"]))
        profiles.append((args.also.name, report["also"]["profile"]))
    for name, rows in profiles:
        total = sum(row["ms_per_step"] for row in rows.values())
        print(f"{name}: {total:.2f} ms/step in the profile")
        for op, row in list(rows.items())[:10]:
            print(f"  {op:32s} {row['ms_per_step']:6.2f} ms/step  {row['nodes']:4d} nodes")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
