"""Peak memory and time of the GGUF writer against the size of the checkpoint it reads.

Runs the writer (no validation) in a fresh process and reads its peak resident set
(VmHWM). The writer maps the safetensors files and converts one tensor at a time, so the
peak should stay well below the checkpoint's size.

    python benchmarks/bench_gguf_convert.py CHECKPOINT_DIR [--outtype f16] [--quant q4_k_m]

CHECKPOINT_DIR: a Hugging Face folder, e.g. $EDGEINFER_HOME/derived/<sha>-r2/hf (the default
model dequantized to float32 by the test fixtures). Linux only (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from pathlib import Path
from edgeinfer.converters.gguf.writer import quantize_gguf, write_gguf
from edgeinfer.memory.rss import peak_rss
src, out, outtype, quant = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
t = time.perf_counter()
write_gguf(src, out, outtype)
written = time.perf_counter() - t
peak_write = peak_rss()
result = {"write_s": written, "peak_write": peak_write, "out_bytes": out.stat().st_size}
if quant != "-":
    t = time.perf_counter()
    q = out.with_name("q.gguf")
    quantize_gguf(out, q, quant, threads=None)
    result.update(quant_s=time.perf_counter() - t, quant_bytes=q.stat().st_size,
                  peak_after_quant=peak_rss())
print(json.dumps(result))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--quant", default="q4_k_m", help="also quantize with llama.cpp; - to skip")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "gguf_convert.json"
    )
    args = ap.parse_args()
    size = sum(p.stat().st_size for p in args.checkpoint.glob("*.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(args.checkpoint), str(Path(tmp) / "m.gguf"),
             args.outtype, args.quant],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(checkpoint_bytes=size, outtype=args.outtype, quant=args.quant)
    print(f"checkpoint (safetensors): {size / 1e6:.0f} MB")
    print(
        f"write {args.outtype}: {result['write_s']:.1f} s, output {result['out_bytes'] / 1e6:.0f}"
        f" MB, peak RSS {result['peak_write'] / 1e6:.0f} MB "
        f"({result['peak_write'] / size:.0%} of the checkpoint)"
    )
    if "quant_s" in result:
        print(
            f"quantize {args.quant} (llama.cpp): {result['quant_s']:.1f} s, output "
            f"{result['quant_bytes'] / 1e6:.0f} MB, process peak "
            f"{result['peak_after_quant'] / 1e6:.0f} MB"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
