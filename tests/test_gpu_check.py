"""The GPU check's CPU-side logic (gpu_check/): nvidia-smi's answers parsed, the CMake
arguments for the GPUs found, the CUDA library search, the slimmed sdist, and the whole run
on this CPU machine with a stand-in nvidia-smi and ``--skip-build``.

nvidia-smi's answers below are written in its CSV format (``--format=csv,noheader,nounits``);
the H200's values are the ones read on this workplace's lent machine (name, 143771 MiB,
driver 580.159.03; compute capability 9.0 is the H200's). No GPU is used here.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.machine.inventory import build_inventory
from edgeinfer.machine.probes import RecordedProbe
from gpu_check import nvidia
from gpu_check.nvidia import CheckError, Gpu
from gpu_check.run import summarise
from gpu_check.sdist import DROPPED, slim

REPO = Path(__file__).resolve().parents[1]
H200 = "0, NVIDIA H200, 9.0, 143771, 0, 580.159.03\n"
MIXED = (
    "0, NVIDIA GeForce RTX 4090, 8.9, 24564, 1, 550.54.14\n"
    "1, NVIDIA A100-SXM4-80GB, 8.0, 81920, 0, 550.54.14\n"
    "2, NVIDIA A100-SXM4-80GB, 8.0, 81920, 0, 550.54.14\n"
)
NOT_KNOWN = "0, NVIDIA GeForce GTX 1080, [N/A], [N/A], [N/A], 470.256.02\n"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
    "that the latest NVIDIA driver is installed and running.\n"
)
OLD_DRIVER = 'Field "compute_cap" is not a valid field to query.\n'


def test_an_h200_builds_for_90_only() -> None:
    (gpu,) = nvidia.parse_gpus(H200)
    assert gpu == Gpu(0, "NVIDIA H200", "9.0", 143771, 0, "580.159.03")
    archs = nvidia.cuda_architectures([gpu])
    assert archs == ["90"]
    args = nvidia.cmake_args(archs)
    assert " ".join(args) == "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF"


def test_several_gpus_build_for_each_architecture_once() -> None:
    gpus = nvidia.parse_gpus(MIXED)
    assert [g.index for g in gpus] == [0, 1, 2] and gpus[1].memory_total_mib == 81920
    assert nvidia.cuda_architectures(gpus) == ["80", "89"]
    assert "-DCMAKE_CUDA_ARCHITECTURES=80;89" in nvidia.cmake_args(["80", "89"])
    blackwell = nvidia.parse_gpus("0, NVIDIA RTX PRO 6000, 12.0, 97887, 0, 575.57.08")
    assert nvidia.cuda_architectures(blackwell) == ["120"]


def test_an_unknown_capability_asks_for_arch() -> None:
    (gpu,) = nvidia.parse_gpus(NOT_KNOWN)
    assert gpu.compute_cap is None and gpu.memory_total_mib is None
    with pytest.raises(CheckError, match="pass --arch"):
        nvidia.cuda_architectures([gpu])


@pytest.mark.parametrize("answer", [NO_DRIVER, OLD_DRIVER, "", "\n\n", "0, only, three\n"])
def test_answers_of_another_shape_are_one_error(answer: str) -> None:
    with pytest.raises(CheckError, match="nvidia-smi"):
        nvidia.parse_gpus(answer)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_nvidia_smi_text_is_gpus_or_one_error(text: str) -> None:
    try:
        gpus = nvidia.parse_gpus(text)
    except CheckError as exc:
        assert "nvidia-smi" in str(exc)
        return
    assert gpus and all(isinstance(g.index, int) for g in gpus)
    try:
        archs = nvidia.cuda_architectures(gpus)
    except CheckError:
        return
    assert nvidia.cmake_args(archs)[1].startswith("-DCMAKE_CUDA_ARCHITECTURES=")
    assert isinstance(nvidia.parse_process_memory(text), dict)
    nvidia.parse_offloaded(text.splitlines())


def test_cmake_args_refuse_what_cmake_args_cannot_carry() -> None:
    with pytest.raises(CheckError):
        nvidia.cmake_args([])
    with pytest.raises(CheckError):
        nvidia.cmake_args(["sm_90"])
    with pytest.raises(CheckError, match="whitespace"):
        nvidia.cmake_args(["90"], {"CUDA_cublas_LIBRARY": "/a b/libcublas.so.13"})
    args = nvidia.cmake_args(["90"], {"CUDA_cublas_LIBRARY": "/x/libcublas.so.13"})
    assert args[-1] == "-DCUDA_cublas_LIBRARY=/x/libcublas.so.13"


def test_process_memory_nvcc_and_the_offload_line() -> None:
    assert nvidia.parse_process_memory("1234, 420\n1234, 10\n99, [N/A]\nbad\n") == {1234: 430}
    version = "Cuda compilation tools, release 13.0, V13.0.88\nBuild cuda_13.0.r13.0"
    assert nvidia.parse_nvcc_version(version) == "13.0"
    assert nvidia.parse_nvcc_version("nvcc: command not found") is None
    log = [
        "load_tensors: offloading 30 repeating layers to GPU",
        "load_tensors: offloaded 31/31 layers to GPU",
        "llama_context: n_ctx = 4096",
    ]
    assert nvidia.parse_offloaded(log) == (31, 31)
    assert nvidia.parse_offloaded(["llama_context: CPU only"]) is None


def _lister(tree: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    return lambda folder: tree.get(folder, [])


def test_cuda_libraries_missing_from_the_toolkit_are_named() -> None:
    toolkit = ["/usr/local/cuda/lib64", "/usr/local/cuda/lib64/stubs"]
    full = {"/usr/local/cuda/lib64": ["libcublas.so", "libcublasLt.so", "libcudart.so"],
            "/usr/local/cuda/lib64/stubs": ["libcuda.so"]}  # fmt: skip
    assert nvidia.cuda_libraries(toolkit, ["/pip/nvidia/cu13/lib"], _lister(full)) == ({}, [], [])
    bare = {  # the compiler alone; cuBLAS from the pip packages, the driver mounted
        "/usr/local/cuda/lib64": ["libcudart.so", "libcudart.so.13"],
        "/pip/nvidia/cu13/lib": ["libcublas.so.13", "libcublasLt.so.13", "libnvrtc.so.13"],
        "/usr/local/nvidia/lib64": ["libcuda.so.1", "libcuda.so.580.159.03"],
    }
    others = ["/pip/nvidia/cu13/lib", "/usr/local/nvidia/lib64"]
    defines, folders, missing = nvidia.cuda_libraries(toolkit, others, _lister(bare))
    assert defines == {
        "CUDA_cublas_LIBRARY": "/pip/nvidia/cu13/lib/libcublas.so.13",
        "CUDA_cublasLt_LIBRARY": "/pip/nvidia/cu13/lib/libcublasLt.so.13",
        "CUDA_cuda_driver_LIBRARY": "/usr/local/nvidia/lib64/libcuda.so.1",
    }
    assert folders == others and missing == []
    assert nvidia.cuda_libraries(toolkit, [], _lister(bare))[2] == ["cublas", "cublasLt", "cuda"]
    headers = {"/pip/nvidia/cu13/include": ["cublas_v2.h", "cublasLt.h"]}
    assert nvidia.cublas_include(["/usr/local/cuda/include"], list(headers), _lister(headers)) == (
        "/pip/nvidia/cu13/include"
    )
    with_headers = {"/usr/local/cuda/include": ["cublas_v2.h"], **headers}
    assert nvidia.cublas_include(["/usr/local/cuda/include"], list(headers),
                                 _lister(with_headers)) is None  # fmt: skip


# -- the slimmed sdist ---------------------------------------------------------------------------


def _sdist(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


def test_the_sdist_keeps_what_the_build_reads(tmp_path: Path) -> None:
    top = "llama_cpp_python-9.9.9"
    kept = [f"{top}/CMakeLists.txt", f"{top}/llama_cpp/__init__.py",
            f"{top}/vendor/llama.cpp/ggml/src/ggml-cuda/common.cuh",
            f"{top}/vendor/llama.cpp/tools/mtmd/CMakeLists.txt",
            f"{top}/vendor/llama.cpp/models-list.txt"]  # fmt: skip
    gone = [f"{top}/.git/modules/pack", f"{top}/vendor/llama.cpp/models/ggml-vocab-x.gguf",
            f"{top}/vendor/llama.cpp/docs/ops/CUDA.csv", f"{top}/tests/test_llama.py"]  # fmt: skip
    src = _sdist(tmp_path / "src.tar.gz", {n: n.encode() for n in kept + gone})
    summary = slim(src, tmp_path / "out.tar.gz")
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(kept)
    assert (summary["members_kept"], summary["members_dropped"]) == (len(kept), len(gone))
    (tmp_path / "again").mkdir()
    again = slim(src, tmp_path / "again" / "out.tar.gz")  # the same name: the same bytes
    assert again["slim_sha256"] == summary["slim_sha256"]
    assert summary["dropped_paths"] == list(DROPPED)


@pytest.mark.parametrize(
    ("members", "links"),
    [({"../evil": b"x"}, None), ({"/abs/evil": b"x"}, None), ({}, {"top/link": "/etc/passwd"}),
     ({}, {"top/link": "../../x"})],
)  # fmt: skip
def test_the_sdist_refuses_members_that_leave_it(
    tmp_path: Path, members: dict[str, bytes], links: dict[str, str] | None
) -> None:
    src = _sdist(tmp_path / "src.tar.gz", members, links)
    with pytest.raises(ValueError, match=r"outside|leaves"):
        slim(src, tmp_path / "out.tar.gz")


# -- the whole run on this CPU machine -----------------------------------------------------------


def _stand_in(folder: Path, answer: str, status: int = 0) -> Path:
    """A folder with an ``nvidia-smi`` that answers the GPU query with ``answer``."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\ncase \"$1\" in\n  --query-gpu=*) cat <<'EOF'\n"
        f"{answer}EOF\n  exit {status};;\nesac\nexit 0\n"
    )
    script.chmod(0o755)
    return folder


def _gpu_check(
    tmp_path: Path, answer: str, *args: str, status: int = 0
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PATH"] = f"{_stand_in(tmp_path / 'bin', answer, status)}{os.pathsep}{env['PATH']}"
    env["EDGEINFER_HOME"] = str(tmp_path / "home")  # empty: the catalog models are skipped
    (tmp_path / "wheels").mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "gpu_check.run", "--out", str(tmp_path / "out" / "r.json")]
    argv += ["--work", str(tmp_path / "work"), "--wheels", str(tmp_path / "wheels"), *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


def test_the_whole_check_runs_here_with_a_stand_in_nvidia_smi(tmp_path: Path) -> None:
    done = _gpu_check(tmp_path, H200, "--skip-build", "--max-new-tokens", "8",
                      "--context-length", "256", "--model-timeout", "300")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpu: NVIDIA H200 (compute 9.0, 143771 MiB), driver 580.159.03")
    assert lines[0].endswith("building for 90")
    results = json.loads((tmp_path / "out" / "r.json").read_text())
    assert results["schema"] == 1 and "gpu_check.run" in results["command"]
    assert [s["name"] for s in results["steps"]][:3] == ["machine", "wheels", "versions"]
    assert results["versions"]["llama_cpp"] and results["versions"]["edgeinfer"]
    recorded = build_inventory(RecordedProbe(results["machine_record"]))
    assert recorded.packages is not None and "llama_cpp" in recorded.packages
    tiny, default, coder = results["models"]
    assert (tiny["name"], tiny["status"]) == ("tiny-random-llama", "measured")
    assert tiny["auto"]["provider"] == "llama.cpp:CPU" and tiny["auto"]["completion_tokens"] == 8
    assert tiny["cpu"]["route"]["why"] == "engine='llama.cpp' was asked for"
    assert tiny["auto"]["memory_plan"]["weights"] > 0 and "decode_speedup" in tiny
    for entry in (default, coder):  # not in the empty $EDGEINFER_HOME: skipped, not fetched
        assert entry["status"] == "skipped", entry
        assert "fetches nothing" in entry["why"] or "not in this checkout's catalog" in entry["why"]
        assert f"{entry['name']}: skipped: " in done.stdout
    assert not (tmp_path / "home" / "models").exists()


def test_without_an_nvidia_driver_the_check_says_so_in_one_line(tmp_path: Path) -> None:
    done = _gpu_check(tmp_path, NO_DRIVER, status=9)
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpu_check: error: nvidia-smi failed") and "NVIDIA machine" in line


def test_a_build_without_the_sdist_stops_with_a_line(tmp_path: Path) -> None:
    done = _gpu_check(tmp_path, H200)
    assert done.returncode == 1
    assert "build: no llama_cpp_python-*.tar.gz in" in done.stdout and "gather.sh" in done.stdout
    steps = json.loads((tmp_path / "out" / "r.json").read_text())["steps"]
    assert steps[-1] == {"name": "build", "seconds": steps[-1]["seconds"], "ok": False}


def test_the_summary_line_of_a_gpu_run() -> None:
    auto = {"provider": "llama.cpp:CUDA", "route": {"format": "gguf"}, "layers_offloaded": [31, 31],
            "decode_tokens_per_s": 612.5,
            "memory_plan": {"weights": 100 * 2**20, "kv_cache": 40 * 2**20, "compute": 20 * 2**20},
            "gpu_memory": {"before_load": {"used_mib": [0], "process_mib": None},
                           "after_load": {"used_mib": [420], "process_mib": 410}}}  # fmt: skip
    entry = {"name": "m", "status": "measured", "auto": auto, "decode_speedup": 5.1,
             "cpu": {"provider": "llama.cpp:CPU", "decode_tokens_per_s": 120.0}}  # fmt: skip
    assert summarise(entry) == (
        "m: auto -> llama.cpp:CUDA (route gguf), 31/31 layers offloaded, 612.5 tok/s decode; "
        "cpu llama.cpp:CPU 120.0 tok/s (5.1x); memory plan 160 MiB (weights+KV+compute), "
        "nvidia-smi: process 410 MiB, card +420 MiB after the load"
    )
    assert summarise({"name": "q", "status": "skipped", "why": "absent"}) == "q: skipped: absent"


def test_the_scripts_parse_and_gather_refuses_a_folder_in_use(tmp_path: Path) -> None:
    for script in ("gather.sh", "run.sh"):
        assert subprocess.run(["sh", "-n", str(REPO / "gpu_check" / script)]).returncode == 0
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "old.whl").write_bytes(b"")
    done = subprocess.run([str(REPO / "gpu_check" / "gather.sh"), str(tmp_path / "used")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "is not empty" in done.stderr
