"""What a GGUF -> ONNX transcode costs: the folder's size against its GGUF file, and the peak
resident memory (``VmHWM``) of the process that converts it, each conversion in a fresh child
process (``write_gguf_folder``, as ``edgeinfer convert`` runs it before validating).

``--before REV`` converts the same files with the builder of git revision ``REV`` too
(``converters/onnx/builder`` taken from git, the rest of the tree as it is), side by side in
the same run. ``--alternatives`` also converts with ``--quant int4 --head-8bit`` and
``--quant int4`` (re-rounded, not exact) and measures their size and their agreement with
the exact transcode: teacher-forced top-1 agreement and the largest logit difference over a
few prompts (onnxruntime, one thread).

    taskset -c 1 nice -n 19 python benchmarks/transcode_memory.py --before e599293 --alternatives
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conditions

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path.home() / ".cache" / "edgeinfer" / "models"
DEFAULT_SOURCES = [
    MODELS / "qwen2.5-coder-0.5b-instruct" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    MODELS / "qwen2.5-coder-1.5b-instruct" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
]
ALTERNATIVES = {"int4-head8": ("int4", 8), "int4": ("int4", None)}
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ",
    "import json\n\ndef load_config(path):\n    with open(path) as fh:\n        return ",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "Write a function that checks whether a string is a palindrome, ignoring case and spaces.",
    "for (int i = 0; i < n; ++i) {\n    sum += values[i] * weights[i];\n}\nreturn sum / ",
    "<|im_start|>user\nExplain what a hash map is in one sentence.<|im_end|>\n<|im_start|>",
]

# The child: converts, then reports its own high-water mark of resident memory.
_CHILD = r"""
import importlib.util, json, sys, time
src, out, quant, head_bits, context, builder = sys.argv[1:7]
if builder:  # another revision's builder package, the rest of the tree as it is
    import edgeinfer.converters.onnx  # noqa: F401
    spec = importlib.util.spec_from_file_location(
        "edgeinfer.converters.onnx.builder", builder + "/__init__.py",
        submodule_search_locations=[builder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
from edgeinfer.converters.onnx.folder import write_gguf_folder
start = time.perf_counter()
_, report = write_gguf_folder(src, out, quant=quant, head_bits=int(head_bits) or None,
                              max_context=int(context))
seconds = time.perf_counter() - start
status = open("/proc/self/status").read().split("\n")
hwm = [int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")][0]
print(json.dumps({"seconds": seconds, "vm_hwm": hwm, "nbits": report.nbits,
                  "widened": report.widened}))
"""


def convert(src: Path, out: Path, quant: str, head_bits: int | None, context: int,
            builder: Path | None) -> dict[str, Any]:  # fmt: skip
    """One conversion in a fresh child: its seconds, VmHWM, and RSS sampled every 10 ms."""
    out.mkdir(parents=True)
    args = [src, out, quant, head_bits or 0, context, builder or ""]
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *map(str, args)], stdout=subprocess.PIPE, text=True
    )
    sampled = 0
    proc = psutil.Process(child.pid)
    while child.poll() is None:
        try:
            sampled = max(sampled, proc.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(0.01)
    stdout, _ = child.communicate()
    if child.returncode:
        raise SystemExit(f"conversion of {src.name} failed ({child.returncode})")
    record = json.loads(stdout.strip().splitlines()[-1])
    record["sampled_peak_rss"] = sampled
    return record


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def measured(src: Path, out: Path, quant: str, head_bits: int | None, context: int,
             builder: Path | None) -> dict[str, Any]:  # fmt: skip
    """A conversion's record with the sizes and ratios to its source file."""
    record = convert(src, out, quant, head_bits, context, builder)
    source = src.stat().st_size
    record.update(
        source_bytes=source,
        folder_bytes=folder_bytes(out),
        data_bytes=(out / "model.onnx.data").stat().st_size,
        peak_rss=record["vm_hwm"],
    )
    record["folder_ratio"] = record["folder_bytes"] / source
    record["peak_rss_ratio"] = record["peak_rss"] / source
    return record


def _logits(folder: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    """Every position's logits of each prompt, one prefill each (one thread)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(folder / "model.onnx"), options)
    out = []
    for ids in prompts:
        feed = {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, len(ids)), np.int64),
            "num_logits_to_keep": np.array([len(ids)], np.int64),
        }
        for i in session.get_inputs():
            if i.name.startswith("past_key_values"):
                feed[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        out.append(session.run(["logits"], feed)[0][0])
    return out


def agreement(reference: list[np.ndarray], other: list[np.ndarray]) -> dict[str, Any]:
    """Teacher-forced top-1 agreement and the largest logit difference, over all positions."""
    ref, got = np.concatenate(reference), np.concatenate(other)
    return {
        "positions": len(ref),
        "top1_agreement": float(np.mean(ref.argmax(-1) == got.argmax(-1))),
        "max_abs_logit_diff": float(np.abs(ref - got).max()),
        "reference_max_abs_logit": float(np.abs(ref).max()),
    }


def _prompt_ids(folder: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]


def _builder_at(rev: str, into: Path) -> Path:
    """``converters/onnx/builder`` of git revision ``rev``, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "converters/onnx/builder"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "converters" / "onnx" / "builder"


def run_source(src: Path, args: argparse.Namespace, tmp: Path, old: Path | None) -> dict:
    """The source's exact transcode (and the other builder's, and the alternatives)."""
    exact = tmp / f"{src.stem}-keep"
    row: dict[str, Any] = {
        "source": src.name,
        "keep": measured(src, exact, "keep", None, args.context, None),
    }
    print(json.dumps({src.name: row["keep"]}), flush=True)
    if old is not None:
        before = tmp / f"{src.stem}-before"
        row["keep_before"] = measured(src, before, "keep", None, args.context, old)
        row["keep_before"]["revision"] = args.before
        print(json.dumps({"before": row["keep_before"]}), flush=True)
        _remove(before)
    if args.alternatives:
        prompts = _prompt_ids(exact)
        reference = _logits(exact, prompts)
        for name, (quant, head_bits) in ALTERNATIVES.items():
            folder = tmp / f"{src.stem}-{name}"
            record = measured(src, folder, quant, head_bits, args.context, None)
            record["agreement_with_keep"] = agreement(reference, _logits(folder, prompts))
            row[name] = record
            print(json.dumps({name: record}), flush=True)
            _remove(folder)
    _remove(exact)
    return row


def _remove(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            f.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", type=Path, default=DEFAULT_SOURCES)
    parser.add_argument("--context", type=int, default=4096, help="max_context of the graph")
    parser.add_argument("--before", help="also convert with this git revision's builder")
    parser.add_argument("--alternatives", action="store_true", help="int4 size and agreement")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp"), help="where folders go")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "transcode_memory.json"
    )
    args = parser.parse_args()
    started = conditions.start(threads=1, rounds=1, wait=False)
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="transcode-") as tmp:
        old = _builder_at(args.before, Path(tmp)) if args.before else None
        rows = [run_source(src, args, Path(tmp) / "out", old) for src in args.sources]
    result = {
        "what": "GGUF -> ONNX folder (write_gguf_folder) in a fresh child process each",
        "context": args.context,
        "prompts": PROMPTS if args.alternatives else None,
        "sources": rows,
        "conditions": conditions.finish(started),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
