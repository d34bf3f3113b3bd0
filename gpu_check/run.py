"""The prepared GPU check: one command on an NVIDIA machine with nvcc and CMake, no network.

    python3 -m gpu_check.run --wheels gpu_check/wheels --out results.json

Steps, each within what is left of ``--deadline`` seconds, each written to ``--out`` as it
ends (a run stopped at its limit keeps what it had): read the GPUs (``nvidia-smi``), nvcc and
CMake; install the carried wheels (``gather.sh`` made the folder) into a folder of its own;
build llama-cpp-python from the carried sdist with CUDA for this machine's GPUs only
(``nvidia.cmake_args``); record the machine as ``edgeinfer devices --record`` does; then for
each model, ``load(device="auto")`` and the CPU route (``device="cpu"``, llama.cpp on the same
file), each in a fresh process (``gpu_check.measure``): provider chosen, layers offloaded,
decode tok/s, the memory plan against what nvidia-smi shows. The models: a tiny random-weight
Llama written on the spot (it checks the build and the offload, its speed says nothing about
a real model), the catalog's default model and qwen2.5-coder-1.5b-instruct; a catalog model
not in ``$EDGEINFER_HOME`` is skipped with a line that says so (nothing is fetched).

This module imports nothing outside the standard library, so it runs before anything is
installed; edgeinfer runs from this checkout (``source_tree``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .nvidia import (
    GPU_QUERY,
    CheckError,
    cmake_args,
    cublas_include,
    cuda_architectures,
    cuda_libraries,
    parse_gpus,
    parse_nvcc_version,
)

REPO = Path(__file__).resolve().parents[1]
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct")  # catalog names
TINY = "tiny-random-llama"
SCHEMA = 1


class Budget:
    """Seconds left before ``deadline`` (from the start), less a reserve for the last write."""

    def __init__(self, deadline: float, reserve: float = 10.0) -> None:
        self.start = time.monotonic()
        self.deadline = deadline
        self.reserve = reserve

    def left(self) -> float:
        return self.deadline - self.reserve - (time.monotonic() - self.start)

    def cap(self, most: float) -> float:
        return max(0.0, min(most, self.left()))


class Results:
    """The results file, written again (whole, atomically) after every step."""

    def __init__(self, path: Path, command: list[str]) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "schema": SCHEMA,
            "command": " ".join(command),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "steps": [],
            "models": [],
        }

    def step(self, name: str, seconds: float, ok: bool, **facts: Any) -> None:
        self.data["steps"].append({"name": name, "seconds": round(seconds, 1), "ok": ok})
        self.data.update(facts)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(json.dumps(self.data, indent=1) + "\n", encoding="utf-8")
        os.replace(part, self.path)


def say(line: str) -> None:
    print(line, flush=True)


def command(argv: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``argv``'s run; a missing program or a timeout reads as exit 127 / 124 with a line."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=max(timeout, 1), check=False, **kw
        )
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: not found")
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return subprocess.CompletedProcess(argv, 124, out, f"timed out after {timeout:.0f} s")


def machine(budget: Budget, arch: str | None) -> dict[str, Any]:
    """The GPUs, driver, nvcc, CMake and CPUs; CheckError without nvidia-smi's answer."""
    smi = command(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"],
                  budget.cap(60))  # fmt: skip
    if smi.returncode != 0:
        raise CheckError(
            f"nvidia-smi failed ({(smi.stderr or smi.stdout).strip()[:200]}): this check runs "
            "on an NVIDIA machine with its driver loaded"
        )
    gpus = parse_gpus(smi.stdout)
    archs = [arch] if arch else cuda_architectures(gpus)
    nvcc = command(["nvcc", "--version"], budget.cap(30))
    cmake = command(["cmake", "--version"], budget.cap(30))
    return {
        "gpus": [vars(g) for g in gpus],
        "cuda_architectures": archs,
        "nvcc": parse_nvcc_version(nvcc.stdout) if nvcc.returncode == 0 else None,
        "cmake": cmake.stdout.splitlines()[0] if cmake.returncode == 0 else None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def source_tree(work: Path) -> Path:
    """A folder where ``import edgeinfer`` finds this checkout with runtimes/ and converters/
    as its subpackages (the wheel's layout), made of links: nothing is built or copied."""
    root = work / "src"
    package = root / "edgeinfer"
    if root.exists():
        shutil.rmtree(root)
    package.mkdir(parents=True)
    for entry in (REPO / "edgeinfer").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in ("runtimes", "converters"):
        (package / folder).symlink_to(REPO / folder)
    return root


def child_env(work: Path, src: Path, lib_dirs: list[str]) -> dict[str, str]:
    """The environment of every step after the install: the carried packages first, then this
    checkout's edgeinfer, then the repository (for gpu_check and tests.ggufgen)."""
    env = dict(os.environ)
    paths = [str(work / "site"), str(src), str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            lib_dirs + [p for p in [env.get("LD_LIBRARY_PATH")] if p]
        )
    env["PYTHONUNBUFFERED"] = "1"
    return env


def install_wheels(wheels: Path, work: Path, budget: Budget) -> tuple[bool, str]:
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        return True, "no wheels to install"
    done = command([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--upgrade", "--target", str(work / "site"), *found],
                   budget.cap(120))  # fmt: skip
    names = ", ".join(Path(w).name for w in found)
    return done.returncode == 0, names if done.returncode == 0 else done.stderr[-2000:]


def cuda_toolkit() -> Path | None:
    """The CUDA toolkit's folder: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, or nvcc's."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "include").is_dir():
            return Path(candidate)
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parents[1] if nvcc else None


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def cuda_defines(toolkit: Path | None) -> tuple[dict[str, str], list[str], list[str]]:
    """CMake entries for the CUDA libraries the toolkit lacks, their folders, and what is
    missing everywhere (``nvidia.cuda_libraries`` over this machine's folders)."""
    base = [toolkit / "lib64", toolkit / "lib64" / "stubs"] if toolkit else []
    if toolkit:
        base += [Path(p) for p in glob.glob(str(toolkit / "targets" / "*" / "lib"))]
        base += [p / "stubs" for p in list(base) if p.name == "lib"]
    sites = [p for p in sys.path if p.endswith("site-packages")]
    pip_libs = [q for s in sites for q in glob.glob(os.path.join(s, "nvidia", "*", "lib"))]
    driver = ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu",
              "/usr/lib64", "/usr/lib/wsl/lib"]  # fmt: skip
    defines, folders, missing = cuda_libraries([str(p) for p in base], pip_libs + driver, _listdir)
    includes = [str(toolkit / "include")] if toolkit else []
    include = cublas_include(includes, [str(Path(p).parent / "include") for p in pip_libs],
                             _listdir)  # fmt: skip
    if include:
        defines["CMAKE_CUDA_FLAGS"] = f"-I{include}"
    return defines, folders, missing


def build(wheels: Path, work: Path, env: dict[str, str], archs: list[str], budget: Budget,
          defines: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """llama-cpp-python from the carried sdist, with CUDA for ``archs``, into work/site."""
    sdists = sorted(wheels.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        return {"ok": False, "why": f"no llama_cpp_python-*.tar.gz in {wheels} (run gather.sh)"}
    args = cmake_args(archs, defines)
    build_env = {**env, "CMAKE_ARGS": " ".join(args), "FORCE_CMAKE": "1",
                 "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4)}  # fmt: skip
    start = time.monotonic()
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
    pip += ["--no-build-isolation", "--no-cache-dir", "--upgrade"]
    pip += ["--target", str(work / "site"), str(sdists[-1])]
    done = command(pip, budget.cap(480), env=build_env)
    log = work / "build.log"
    log.write_text(done.stdout + "\n" + done.stderr, encoding="utf-8")
    return {
        "ok": done.returncode == 0,
        "sdist": sdists[-1].name,
        "cmake_args": build_env["CMAKE_ARGS"],
        "seconds": round(time.monotonic() - start, 1),
        "log_tail": (done.stdout + done.stderr)[-3000:],
    }


_VERSIONS = """
import json, importlib.metadata as md, edgeinfer, llama_cpp
out = {"edgeinfer": edgeinfer.__version__, "llama_cpp": llama_cpp.__version__,
       "llama_gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}
for name in ("numpy", "onnxruntime", "onnx", "jinja2", "psutil"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def versions_and_record(env: dict[str, str], work: Path, budget: Budget) -> dict[str, Any]:
    """The packages the loads will use, and this machine recorded as ``devices --record``."""
    done = command([sys.executable, "-c", _VERSIONS], budget.cap(60), env=env)
    versions = _last_json(done) or {"error": done.stderr[-1000:]}
    record = work / "machine-record.json"
    rec = command([sys.executable, "-m", "edgeinfer", "devices", "--record", str(record)],
                  budget.cap(60), env=env)  # fmt: skip
    recorded = json.loads(record.read_text()) if rec.returncode == 0 else rec.stderr[-1000:]
    return {"versions": versions, "machine_record": recorded}


def _last_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any] | None:
    lines = done.stdout.strip().splitlines()
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def measure(spec: dict[str, Any], env: dict[str, str], budget: Budget) -> dict[str, Any]:
    """One ``gpu_check.measure`` process; its JSON, or why there is none."""
    limit = budget.cap(float(spec.pop("timeout", 240)))
    if limit < 20:
        return {"skipped": f"{budget.left():.0f} s left before the deadline"}
    done = command([sys.executable, "-m", "gpu_check.measure", json.dumps(spec)], limit,
                   env=env, cwd=str(REPO))  # fmt: skip
    return _last_json(done) or {
        "error": f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-1500:]}"
    }


def check_model(name: str, work: Path, env: dict[str, str], budget: Budget,
                opts: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """``load(device="auto")`` and the CPU route for one model, each in its own process."""
    tiny = name == TINY
    common: dict[str, Any] = {
        "model": str(work / "tiny.gguf") if tiny else name,
        "write_tiny" if tiny else "catalog": True,
        "max_new_tokens": opts.max_new_tokens,
        "timeout": opts.model_timeout,
    }
    context = {"context_length": opts.context_length}
    auto = measure({**common, "load": {"device": "auto", **context}}, env, budget)
    if "skipped" in auto or "error" in auto:
        return {"name": name, "status": "skipped" if "skipped" in auto else "failed",
                "why": auto.get("skipped") or auto.get("error")}  # fmt: skip
    cpu_load = {"device": "cpu", "engine": "llama.cpp", **context}
    cpu = measure({**common, "load": cpu_load}, env, budget)
    entry: dict[str, Any] = {"name": name, "status": "measured", "auto": auto, "cpu": cpu}
    if tiny:
        entry["note"] = "random weights written here: checks the build and the offload only"
    fast, slow = auto.get("decode_tokens_per_s"), cpu.get("decode_tokens_per_s")
    if fast and slow:
        entry["decode_speedup"] = round(fast / slow, 2)
    return entry


def summarise(entry: dict[str, Any]) -> str:
    """One line for a model's entry: what auto chose and how fast, against the CPU route."""
    name = entry["name"]
    if entry["status"] != "measured":
        return f"{name}: {entry['status']}: {entry['why']}"
    auto, cpu = entry["auto"], entry["cpu"]
    route = (auto.get("route") or {}).get("format")
    layers = auto.get("layers_offloaded")
    offload = f"{layers[0]}/{layers[1]} layers offloaded" if layers else "no layer offloaded"
    line = (f"{name}: auto -> {auto.get('provider')} (route {route}), {offload}, "
            f"{auto.get('decode_tokens_per_s')} tok/s decode")  # fmt: skip
    if "error" in cpu or "skipped" in cpu:
        line += f"; cpu route: {cpu.get('error') or cpu.get('skipped')}"
    else:
        line += f"; cpu {cpu.get('provider')} {cpu.get('decode_tokens_per_s')} tok/s"
        line += f" ({entry['decode_speedup']}x)" if "decode_speedup" in entry else ""
    return line + _memory_text(auto)


def _memory_text(result: dict[str, Any]) -> str:
    plan = result.get("memory_plan") or {}
    planned = sum(int(plan.get(k) or 0) for k in ("weights", "kv_cache", "compute"))
    gpu = result.get("gpu_memory") or {}
    before, after = gpu.get("before_load") or {}, gpu.get("after_load") or {}
    if not after:
        return f"; memory plan {planned / 2**20:.0f} MiB (weights+KV+compute), no nvidia-smi"
    delta = sum(u or 0 for u in after.get("used_mib", [])) - sum(
        u or 0 for u in before.get("used_mib", [])
    )
    own = after.get("process_mib")
    shown = f"process {own} MiB, " if own is not None else ""
    return (f"; memory plan {planned / 2**20:.0f} MiB (weights+KV+compute), nvidia-smi: "
            f"{shown}card +{delta} MiB after the load")  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m gpu_check.run", description=__doc__)
    p.add_argument("--wheels", type=Path, default=REPO / "gpu_check" / "wheels",
                   help="the folder gather.sh filled (default: gpu_check/wheels)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="the results JSON to write")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"), help="scratch folder")
    p.add_argument("--deadline", type=float, default=570, help="seconds for the whole check")
    p.add_argument("--arch", help="CMAKE_CUDA_ARCHITECTURES instead of nvidia-smi's (e.g. 90)")
    p.add_argument(
        "--skip-build",
        action="store_true",
        help="use the llama-cpp-python already importable (a build made earlier)",
    )
    p.add_argument("--models", default=",".join((TINY, *MODELS)),
                   help=f"comma-separated: {TINY} and catalog names")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--model-timeout", type=float, default=240, help="seconds per load")
    return p.parse_args(argv)


def run(opts: argparse.Namespace, argv: list[str]) -> int:
    budget, results = (
        Budget(opts.deadline),
        Results(opts.out, ["python3", "-m", "gpu_check.run", *argv]),
    )
    start = time.monotonic()
    facts = machine(budget, opts.arch)
    results.step("machine", time.monotonic() - start, True, machine=facts)
    say(machine_line(facts))
    opts.work.mkdir(parents=True, exist_ok=True)
    defines, lib_dirs, missing = cuda_defines(cuda_toolkit())
    env = child_env(opts.work, source_tree(opts.work), lib_dirs)
    start = time.monotonic()
    ok, installed = install_wheels(opts.wheels, opts.work, budget)
    results.step("wheels", time.monotonic() - start, ok, wheels=installed)
    say(f"wheels: {installed}" if ok else f"wheels: install failed: {installed}")
    if not opts.skip_build:
        start = time.monotonic()
        built = build(opts.wheels, opts.work, env, facts["cuda_architectures"], budget, defines)
        built["cuda_libraries"] = {"defines": defines, "missing": missing}
        results.step("build", time.monotonic() - start, built["ok"], build=built)
        say(build_line(built))
        if not built["ok"]:
            return 1
    start = time.monotonic()
    found = versions_and_record(env, opts.work, budget)
    results.step("versions", time.monotonic() - start, "error" not in found["versions"], **found)
    say(f"versions: {json.dumps(found['versions'])}")
    for name in [n.strip() for n in opts.models.split(",") if n.strip()]:
        start = time.monotonic()
        entry = check_model(name, opts.work, env, budget, opts)
        results.data["models"].append(entry)
        results.step(f"model {name}", time.monotonic() - start, entry["status"] != "failed")
        say(summarise(entry))
    results.data["elapsed_s"] = round(time.monotonic() - budget.start, 1)
    results.write()
    say(f"results: {opts.out}")
    return 0


def machine_line(facts: dict[str, Any]) -> str:
    gpus = "; ".join(
        f"{g['name']} (compute {g['compute_cap']}, {g['memory_total_mib']} MiB)"
        for g in facts["gpus"]
    )
    driver = facts["gpus"][0]["driver"]
    archs = ";".join(facts["cuda_architectures"])
    return (
        f"gpu: {gpus}, driver {driver}, nvcc {facts['nvcc']}, {facts['cmake']}, "
        f"{facts['cpu_count']} CPUs; building for {archs}"
    )


def build_line(built: dict[str, Any]) -> str:
    if not built.get("cmake_args"):
        return f"build: {built['why']}"
    state = "built" if built["ok"] else "FAILED (build.log's tail is in the results)"
    missing = built.get("cuda_libraries", {}).get("missing")
    gone = f"; not found: {', '.join(missing)}" if missing else ""
    took = f"{built['sdist']} {state} in {built['seconds']} s"
    return f"build: {took}, CMAKE_ARGS={built['cmake_args']}{gone}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    try:
        return run(opts, argv)
    except CheckError as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
