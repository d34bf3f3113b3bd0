"""What a forward pass of a catalog model's ONNX transcode (the default model unless
``--model``) spends its time on, by kind of node: onnxruntime's own profiler over one-token
steps and passes over several tokens.

The exact transcode computes each Q4_1 projection as a 4-bit ``MatMulNBits`` plus the
blocks' offsets: ``MatMul`` (the input's sum over each 32-wide block) then ``MatMul`` (those
sums by each block's offset) and an ``Add``. This says what that costs beside the 4-bit
products, attention and the rest, at 1, 4 and 9 tokens a pass (a decode step and two
speculative verify passes), on a cache already holding ``--past`` positions.

    python benchmarks/onnx_op_profile.py [--model NAME] [--past 256] [--runs 20] [--threads 2]
        [-o benchmarks/results/onnx_op_profile.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import conditions
import numpy as np

from edgeinfer.files import catalog

RESULTS = Path(__file__).parent / "results" / "onnx_op_profile.json"
OFFSET_INPUTS = ("block_sum_", ".offset_t")  # the offset term's constant inputs


def native_folder(model: str) -> Path:
    """A catalog model's exact ONNX transcode, made (once) as load() makes it."""
    import edgeinfer

    with edgeinfer.load(model, engine="onnxruntime", context_length=512) as m:
        folder = Path(str(m.info["path"]))
    if not (folder / "model.onnx").is_file():
        raise SystemExit(f"could not find {model}'s ONNX folder")
    return folder


def _feeds(session: Any, tokens: int, past: int) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.arange(100, 100 + tokens, dtype=np.int64)[None]
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, past + tokens), dtype=np.int64)
        elif i.name == "num_logits_to_keep":
            feeds[i.name] = np.array([tokens], dtype=np.int64)
        elif i.name.startswith("past_key_values"):
            heads, dim = i.shape[1], i.shape[3]
            feeds[i.name] = np.random.default_rng(0).random((1, heads, past, dim), np.float32)
    return feeds


def _kind(name: str, op: str, offset_nodes: set[str], forms: dict[str, str]) -> str:
    """A node's kind: its operator, the offset term's nodes apart, MatMulNBits by its bits
    and block size (``forms``: node name -> "8-bit/16")."""
    if name in offset_nodes:
        return f"{op} (Q4_1 offsets)"
    return f"{op} {forms[name]}" if name in forms else op


def _forms(graph: Any) -> dict[str, str]:
    """Each MatMulNBits node's bits and block size, as "4-bit/32"."""
    forms = {}
    for n in graph.node:
        if n.op_type == "MatMulNBits":
            a = {x.name: x.i for x in n.attribute}
            forms[n.name] = f"{a.get('bits', 4)}-bit/{a.get('block_size')}"
    return forms


def profile(folder: Path, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median microseconds per pass of each kind of node, over ``args.runs`` passes."""
    import onnx
    import onnxruntime as ort

    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    products = {n.name for n in graph.node if n.op_type == "MatMul"
                and any(k in x for x in n.input for k in OFFSET_INPUTS)}  # fmt: skip
    # the Adds that put the offsets onto the 4-bit product: fed by an offset MatMul itself
    # (not by such an Add, or every residual Add after it would count)
    made_by = {o: n.name for n in graph.node for o in n.output}
    adds = {n.name for n in graph.node
            if n.op_type == "Add" and any(made_by.get(x) in products for x in n.input)}  # fmt: skip
    offset_nodes = products | adds
    forms = _forms(graph)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(str(folder / "model.onnx"), options,
                                       providers=["CPUExecutionProvider"])  # fmt: skip
        feeds = _feeds(session, tokens, args.past)
        for _ in range(3):
            session.run(["logits"], feeds)
        for _ in range(args.runs):
            session.run(["logits"], feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"][-args.runs :]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run: list[collections.Counter[str]] = []
    for run in runs:
        start, end = run["ts"], run["ts"] + run["dur"]
        counts: collections.Counter[str] = collections.Counter()
        for e in nodes:
            if start <= e["ts"] <= end:
                name = e["name"].removesuffix("_kernel_time")
                counts[_kind(name, e["args"].get("op_name", "?"), offset_nodes, forms)] += e["dur"]
        per_run.append(counts)
    kinds = sorted({k for c in per_run for k in c})
    by_kind = {k: statistics.median(c.get(k, 0) for c in per_run) for k in kinds}
    total = statistics.median(r["dur"] for r in runs)
    return {"tokens": tokens, "pass_us_median": total,
            "kind_us_median": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "offset_share": sum(v for k, v in by_kind.items() if "offsets" in k) / total,
            "nodes_in_file": dict(collections.Counter(_kind(n.name, n.op_type, offset_nodes, forms)
                                                      for n in graph.node))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=catalog.DEFAULT_MODEL, help="a catalog model")
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,4,9")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    folder = native_folder(args.model)
    cond = conditions.start(args.threads, args.runs)
    passes = [profile(folder, int(n), args) for n in args.tokens.split(",")]
    for p in passes:
        top = ", ".join(f"{k} {v / 1000:.2f} ms" for k, v in list(p["kind_us_median"].items())[:5])
        print(f"{p['tokens']} tokens: {p['pass_us_median'] / 1000:.2f} ms a pass; {top}; "
              f"offsets {p['offset_share']:.1%}")  # fmt: skip
    record = {
        "what": "onnxruntime's profile of a catalog model's exact transcode: median "
        "microseconds per pass by kind of node, the Q4_1 offset term's nodes apart",
        "model": args.model,
        "past": args.past,
        "passes": passes,
        "conditions": conditions.finish(cond),
    }
    conditions.write(args.output, record)


if __name__ == "__main__":
    main()
