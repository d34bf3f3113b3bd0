"""Make tests/data/genai-tiny/: the tiny random Llama of tests/tiny_hf.py, turned into a
folder by onnxruntime-genai's own model builder (fp32, CPU). The builder needs torch and
transformers, so it runs in its own environment:

    python tests/make_genai_tiny.py --builder-python /root/ogbuild-venv/bin/python

Run from the repository root with the project's environment (it builds the checkpoint with
transformers); the folder and tests/data/genai-tiny.json (how it was made) are rewritten."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "data" / "genai-tiny"
PROVENANCE = HERE / "data" / "genai-tiny.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builder-python", required=True, help="a Python with onnxruntime-genai")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from tiny_hf import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as work:
        hf = build_tiny_checkpoint(Path(work) / "hf")
        built = Path(work) / "out"
        cache = Path(work) / "cache"
        command = [args.builder_python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                   "-o", str(built), "-p", "fp32", "-e", "cpu", "-c", str(cache)]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        versions = subprocess.run(
            [args.builder_python, "-c", "import onnxruntime_genai as o, transformers as t; "
             "print(o.__version__, t.__version__)"],
            check=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.copytree(built, OUT)
    record = {
        "made_by": "python tests/make_genai_tiny.py --builder-python PY",
        "builder": "python -m onnxruntime_genai.models.builder -p fp32 -e cpu",
        "onnxruntime_genai": versions[0],
        "transformers": versions[1],
        "source": "tests/tiny_hf.py build_tiny_checkpoint (random weights, seeded)",
        "files": sorted(p.name for p in OUT.iterdir()),
    }
    PROVENANCE.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
