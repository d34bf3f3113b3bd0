"""Peak memory of the native ONNX route beside llama-cpp-python on the same GGUF file.

Each run is a fresh Python process: load the model at a fixed context, read a 128-token
prompt, decode 128 greedy tokens (end-of-sequence ids banned), 2 threads. It reports the
resident set after the load (``VmRSS``), the peak during the load and at the end (``VmHWM``,
what the kernel's OOM killer weighs), decode tokens/s, and, for edgeinfer's own routes, the
memory plan's total beside the peak. Engines run interleaved (A B C, then C B A, ...), the
load average is recorded beside every run, and the figures are medians over the rounds.

    python benchmarks/onnx_memory.py                         # default model, contexts 2048 8192
    python benchmarks/onnx_memory.py --rounds 5 --contexts 2048
    python benchmarks/onnx_memory.py --gguf tiny.gguf --out benchmarks/results/x.json
    python benchmarks/onnx_memory.py --sessions              # onnxruntime session options only
    python benchmarks/onnx_memory.py --summarize FILE.json   # medians in MB added to a file
    python benchmarks/onnx_memory.py --tiny qwen2 --contexts 256 --prompt-tokens 64 \
        --new-tokens 64                                      # a tiny random test family

Engines: ``onnx-native`` (edgeinfer.load of the folder the native builder writes from the
GGUF, built once per invocation into a temporary folder), ``onnx-native-kv16`` (the same
graph built with a float16 KV cache, ``--kv-dtype float16``), ``gguf`` (edgeinfer.load of the
GGUF: llama.cpp through edgeinfer) and ``llama-cpp-python`` (``llama_cpp.Llama`` with
``eval``: no edgeinfer code at all).

``--sessions`` measures a bare ``onnxruntime.InferenceSession`` on the native graph under the
options that could hold one copy of the weights (pre-packing off; pre-packed weights saved
into the external data file and loaded from it; constant folding off): the resident set and
peak at session creation and after 16 decode steps, tokens/s of those steps. Linux only.
Writes benchmarks/results/onnx_memory.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import conditions

HERE = Path(__file__).parent
ENGINES = ("onnx-native", "onnx-native-kv16", "gguf", "llama-cpp-python")
SESSION_MODES = ("default", "no-prepacking", "prepacked-in-file", "no-constant-folding")
TEXT = "The quick brown fox jumps over the lazy dog while the river runs to the sea. "

ENGINE_CHILD = (
    r"""
import json, sys, time
import numpy as np
engine, model = sys.argv[1], sys.argv[2]
ctx, threads, n_prompt, n_new = (int(a) for a in sys.argv[3:7])
banned = json.loads(sys.argv[7])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def prompt(unit):
    return (unit * (n_prompt // len(unit) + 1))[:n_prompt]
planned = None
if engine == "llama-cpp-python":
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=ctx, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    loaded, load_peak = status("VmRSS:"), status("VmHWM:")
    ids = prompt(llm.tokenize(TEXT.encode(), add_bos=False, special=False))
    def logits():
        row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
        row[banned] = -np.inf
        return row
    llm.eval(ids)
    token = int(logits().argmax())
    t0 = time.perf_counter()
    for _ in range(n_new - 1):
        llm.eval([token])
        token = int(logits().argmax())
    decode = (n_new - 1) / (time.perf_counter() - t0)
else:
    import edgeinfer
    llm = edgeinfer.load(model, context_length=ctx, threads=threads)
    loaded, load_peak = status("VmRSS:"), status("VmHWM:")
    ids = prompt(llm.tokenize(TEXT))
    bias = {t: -100.0 for t in banned}
    result = llm.generate(ids, max_new_tokens=n_new, temperature=0, logit_bias=bias)
    decode = result.stats.decode_tokens_per_s
    planned = llm.info["memory_plan"]["total"]
def resident_by_kind():  # MB now: mapped files by name, anonymous memory (heap, arenas)
    kinds, name = {}, None
    for line in open("/proc/self/smaps"):
        f = line.split()
        if not f[0].endswith(":"):
            name = f[5].rsplit("/", 1)[-1] if len(f) >= 6 and f[5].startswith("/") else "anon"
        elif f[0] == "Rss:":
            kinds[name] = kinds.get(name, 0) + int(f[1]) / 1000
    top = sorted(kinds.items(), key=lambda kv: -kv[1])[:6]
    return {k: round(v, 1) for k, v in top}
print(json.dumps({"loaded_rss": loaded, "load_peak_rss": load_peak,
                  "peak_rss": status("VmHWM:"), "decode_tok_s": decode, "planned": planned,
                  "resident_mb_at_end": resident_by_kind()}))
"""
).replace("TEXT", repr(TEXT))

# a bare session on the native graph; one sequence in a preallocated cache (IO binding)
SESSION_CHILD = r"""
import json, os, sys, time
import numpy as np
import onnxruntime as ort
mode, path, saved, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def options():
    o = ort.SessionOptions()
    o.intra_op_num_threads, o.inter_op_num_threads = threads, 1
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return o
kw = {}
o = options()
if mode == "no-prepacking":
    o.add_session_config_entry("session.disable_prepacking", "1")
elif mode == "no-constant-folding":
    kw["disabled_optimizers"] = ["ConstantFolding"]
elif mode == "write-prepacked":  # the optimized graph, pre-packed weights in its data file
    o.optimized_model_filepath = os.path.join(saved, "model.onnx")
    for key, value in (
        ("session.optimized_model_external_initializers_file_name", "model.onnx.data"),
        ("session.optimized_model_external_initializers_min_size_in_bytes", "1024"),
        ("session.save_external_prepacked_constant_initializers", "1"),
    ):
        o.add_session_config_entry(key, value)
    ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
    print(json.dumps({"bytes": os.path.getsize(os.path.join(saved, "model.onnx.data"))}))
    sys.exit(0)
elif mode == "prepacked-in-file":
    path = os.path.join(saved, "model.onnx")
before = status("VmRSS:")
t = time.perf_counter()
s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"], **kw)
row = {"create_s": time.perf_counter() - t, "before_rss": before,
       "session_rss": status("VmRSS:"), "session_peak_rss": status("VmHWM:")}
shape = {i.name: i.shape for i in s.get_inputs()}
past = {n: np.zeros((1, v[1], 512, v[3]), np.float32) for n, v in shape.items()
        if n.startswith("past_key_values")}
b = s.io_binding()
for n, v in past.items():
    b.bind_input(n, "cpu", 0, np.float32, list(v.shape), v.ctypes.data)
    b.bind_output(n.replace("past_key_values", "present"), "cpu", 0, np.float32,
                  list(v.shape), v.ctypes.data)
def step(ids, n_past):
    b.bind_cpu_input("input_ids", np.array([ids], np.int64))
    b.bind_cpu_input("attention_mask", np.ones((1, n_past + len(ids)), np.int64))
    b.bind_output("logits", "cpu")
    s.run_with_iobinding(b)
    return b.get_outputs()[0].numpy()[0, -1]
token = int(step([(17 + 7919 * i) % 40000 for i in range(128)], 0).argmax())
t = time.perf_counter()
for k in range(16):
    token = int(step([token], 128 + k).argmax())
row.update(decode_tok_s=16 / (time.perf_counter() - t), rss=status("VmRSS:"),
           peak_rss=status("VmHWM:"))
print(json.dumps(row))
"""


def _run(code: str, *args: str, timeout: int = 900) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=env,
    )
    load = {"load_before": load_before, "load_after": os.getloadavg()[0]}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1], **load}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), **load}


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _summary(runs: list[dict[str, Any]], contexts: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ctx in contexts:
        per: dict[str, Any] = {}
        for engine in ENGINES:
            rows = [r for r in runs if r["engine"] == engine and r["context"] == ctx]
            rows = [r for r in rows if "error" not in r]
            if not rows:
                continue
            per[engine] = {
                k: _median(rows, k)
                for k in ("peak_rss", "load_peak_rss", "loaded_rss", "decode_tok_s", "planned")
            }
            per[engine]["peak_rss_min_max"] = [
                min(r["peak_rss"] for r in rows),
                max(r["peak_rss"] for r in rows),
            ]
        peer = per.get("llama-cpp-python")
        for engine, key in (("onnx-native", "native"), ("onnx-native-kv16", "native_kv16")):
            if per.get(engine) and peer:
                per[f"{key}_peak_over_llama_cpp_python"] = round(
                    per[engine]["peak_rss"] / peer["peak_rss"], 3
                )
        out[str(ctx)] = per
    return out


def _print_row(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['engine']:>17} {row['context']:>6}  error: {row['error']}", flush=True)
        return
    planned = f"{row['planned'] / 1e6:8.1f}" if row.get("planned") else "       -"
    print(
        f"{row['engine']:>17} {row['context']:>6} {row['loaded_rss'] / 1e6:8.1f} "
        f"{row['load_peak_rss'] / 1e6:8.1f} {row['peak_rss'] / 1e6:8.1f} {planned} "
        f"{row['decode_tok_s']:7.1f}  load {row['load_before']:.1f}",
        flush=True,
    )


def engines_main(args: argparse.Namespace, folder: Path, save: Any) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    print(
        f"{'engine':>17} {'ctx':>6} {'load MB':>8} {'ldpeak':>8} {'peak MB':>8} {'plan MB':>8} "
        f"{'tok/s':>7}"
    )
    for r in range(args.rounds):
        order = list(args.engines) if r % 2 == 0 else list(reversed(args.engines))
        for ctx in args.contexts:
            for engine in order:
                model = str(args.gguf)
                if engine.startswith("onnx-native"):
                    model = str(folder if engine == "onnx-native" else folder.parent / "kv16")
                row = _run(
                    ENGINE_CHILD, engine, model, str(ctx), str(args.threads),
                    str(args.prompt_tokens), str(args.new_tokens), json.dumps(args.banned),
                )  # fmt: skip
                row.update(engine=engine, context=ctx, round=r)
                runs.append(row)
                _print_row(row)
                save({"runs": runs, "summary": _summary(runs, args.contexts)})
    return {"runs": runs, "summary": _summary(runs, args.contexts)}


def sessions_main(args: argparse.Namespace, folder: Path, save: Any) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    saved = folder / "prepacked"
    saved.mkdir(exist_ok=True)
    written = _run(SESSION_CHILD, "write-prepacked", str(folder / "model.onnx"), str(saved), "1")
    print("pre-packed data file:", written, flush=True)
    for r in range(args.rounds):
        modes = SESSION_MODES if r % 2 == 0 else tuple(reversed(SESSION_MODES))
        for mode in modes:
            row = _run(
                SESSION_CHILD, mode, str(folder / "model.onnx"), str(saved), str(args.threads)
            )
            row.update(mode=mode, round=r)
            runs.append(row)
            print(json.dumps(row), flush=True)
            save({"session_runs": runs})
    summary = {}
    for mode in SESSION_MODES:
        rows = [x for x in runs if x["mode"] == mode and "error" not in x]
        if rows:
            keys = ("session_rss", "session_peak_rss", "peak_rss", "rss", "decode_tok_s")
            summary[mode] = {k: _median(rows, k) for k in keys}
    return {"session_runs": runs, "session_summary": summary, "prepacked_file": written}


def in_mb(result: dict[str, Any]) -> dict[str, Any]:
    """The medians again in MB (one decimal) and tok/s (one decimal), as the READMEs quote
    them; ratios as they are."""

    def mb(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: mb(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mb(v) for v in value]
        if isinstance(value, float) and value < 1e4:  # tok/s or a ratio
            return round(value, 3 if value < 10 else 1)
        return round(value / 1e6, 1) if isinstance(value, (int, float)) else value

    return {
        k.replace("summary", "summary_mb"): mb(result[k])
        for k in ("summary", "session_summary")
        if result.get(k)
    }


def summarize(path: Path) -> int:
    """Adds the MB summary to a results file written before it existed."""
    result = json.loads(path.read_text())
    result.update(in_mb(result))
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(in_mb(result), indent=1))
    return 0


def _machine() -> dict[str, Any]:
    import llama_cpp
    import onnxruntime

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_features": conditions.cpu()["simd"],
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "llama_cpp_python": llama_cpp.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="default: the default model's file")
    ap.add_argument(
        "--tiny",
        choices=("llama", "qwen2", "gemma3"),
        help="a tiny random model of the tests' fixtures instead (f32 GGUF, made here)",
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--banned", type=int, nargs="*", default=[0, 1, 2], help="ids never chosen")
    ap.add_argument("--sessions", action="store_true", help="onnxruntime session options only")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "onnx_memory.json")
    ap.add_argument("--summarize", type=Path, help="add the MB summary to a results file")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    tiny_dir = tempfile.TemporaryDirectory(prefix="onnx-memory-tiny-")
    if args.tiny:
        args.gguf = _tiny_gguf(args.tiny, Path(tiny_dir.name))
    elif args.gguf is None:
        from edgeinfer.loader import resolve

        args.gguf = resolve("smollm2-135m-instruct").path
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    result: dict[str, Any] = {
        "command": "python benchmarks/onnx_memory.py " + " ".join(sys.argv[1:]),
        "gguf": args.gguf.name,
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "machine": _machine(),
        "load_average_start": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="onnx-memory-") as tmp:
        folder = Path(tmp) / "native"
        folder.mkdir()
        write_gguf_folder(args.gguf, folder, max_context=max(args.contexts))
        if "onnx-native-kv16" in args.engines:
            (Path(tmp) / "kv16").mkdir()
            write_gguf_folder(
                args.gguf, Path(tmp) / "kv16", max_context=max(args.contexts), kv_dtype="float16"
            )
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def save(part: dict[str, Any]) -> None:  # after every run: a cut-short run keeps its rows
            result.update(part, load_average_end=os.getloadavg())
            result.update(in_mb(result))
            args.out.write_text(json.dumps(result, indent=1) + "\n")

        main_part = sessions_main if args.sessions else engines_main
        save(main_part(args, folder, save))
    tiny_dir.cleanup()
    print(json.dumps(result.get("summary") or result.get("session_summary"), indent=1))
    return 0


def _tiny_gguf(family: str, tmp: Path) -> Path:
    """The tests' tiny random ``family`` written as an f32 GGUF (tests/tiny_hf.py,
    tests/tiny_gemma.py)."""
    sys.path.insert(0, str(HERE.parent))
    if family == "gemma3":
        from tests.tiny_gemma import build_tiny_gemma_checkpoint, write_tiny_gemma_gguf

        folder = build_tiny_gemma_checkpoint(tmp / "hf")
        return write_tiny_gemma_gguf(folder, tmp / "tiny-gemma3-f32.gguf")
    from edgeinfer.converters import convert
    from tests.tiny_hf import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp / "hf", family=family)
    out = tmp / f"tiny-{family}-f32.gguf"
    convert(folder, out, to="gguf", quant="f32")
    return out


if __name__ == "__main__":
    sys.exit(main())
