"""Time from nothing to the first answer, as a new user runs the README's run command: a new
virtual environment, ``pip install -e ".[EXTRA]"`` with pip's cache off, then
``edgeinfer run`` on the default model with an empty ``$EDGEINFER_HOME`` (the model is
fetched, and on the ``onnx`` extra transcoded once, inside the timed run).

    python benchmarks/first_answer.py --extra onnx
    python benchmarks/first_answer.py --extra gguf -o benchmarks/results/first_answer_gguf.json

Everything happens under a temporary folder that is removed afterwards. The load average
is recorded beside the figures (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Explain in two sentences why the sky is blue."


def _timed(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``argv``; seconds to its first byte on stdout and to its end, and its status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    rest = first + proc.stdout.read()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return {
        "returncode": proc.returncode,
        "first_output_s": round(t_first, 2) if first else None,
        "total_s": round(time.perf_counter() - t0, 2),
        "stdout_chars": len(rest),
        "stderr_tail": err.decode(errors="replace").strip()[-400:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", default="onnx", help="the extra the README installs")
    parser.add_argument("-o", "--out", type=Path)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    out = args.out or REPO / "benchmarks" / "results" / f"first_answer_{args.extra}.json"
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="edgeinfer-first-") as tmp:
        venv, home = Path(tmp) / "venv", Path(tmp) / "home"
        env = {**os.environ, "EDGEINFER_HOME": str(home), "PIP_NO_CACHE_DIR": "1"}
        env.pop("VIRTUAL_ENV", None)
        steps = {
            "venv": _timed([sys.executable, "-m", "venv", str(venv)], env, args.timeout),
            "install": _timed(
                [str(venv / "bin" / "pip"), "install", "-q", "-e", f"{REPO}[{args.extra}]"],
                env,
                args.timeout,
            ),
        }
        steps["run"] = _timed(
            [str(venv / "bin" / "edgeinfer"), "run", "smollm2-135m-instruct", "--chat", "-p",
             PROMPT, "-n", "200"],
            env,
            args.timeout,
        )  # fmt: skip
        has_llama = (
            subprocess.run(
                [str(venv / "bin" / "python"), "-c", "import llama_cpp"],
                capture_output=True,
                check=False,
            ).returncode
            == 0
        )
    first = steps["run"]["first_output_s"]
    result = {
        "command": "python benchmarks/first_answer.py " + " ".join(sys.argv[1:]),
        "extra": args.extra,
        "llama_cpp_installed": has_llama,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "steps": steps,
        "install_s": steps["install"]["total_s"],
        "first_answer_s": (
            round(steps["venv"]["total_s"] + steps["install"]["total_s"] + first, 2)
            if first is not None
            else None
        ),
        "ok": all(s["returncode"] == 0 for s in steps.values()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("extra", "install_s", "first_answer_s", "ok")}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
