"""What the GPU check reads from an NVIDIA machine, as pure functions of the tools' text.

``nvidia-smi``'s CSV answers (the GPUs with their compute capability and memory, the memory
each process holds), ``nvcc --version``, llama.cpp's load log (how many layers it offloaded),
and the CMake arguments that build llama-cpp-python with CUDA for the GPUs found and nothing
else: ``-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90`` on an H200. Where the CUDA toolkit
lacks cuBLAS or the driver's stub (a toolkit of the compiler alone, with cuBLAS from NVIDIA's
pip packages), the libraries found elsewhere are named to CMake one by one.

Nothing here runs a command; ``gpu_check.run`` does, and hands the text over.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "GPU_QUERY",
    "PROCESS_QUERY",
    "CheckError",
    "Gpu",
    "cmake_args",
    "cublas_include",
    "cuda_architectures",
    "cuda_libraries",
    "parse_gpus",
    "parse_nvcc_version",
    "parse_offloaded",
    "parse_process_memory",
]

# The fields asked of nvidia-smi, in this order (--format=csv,noheader,nounits).
GPU_QUERY = "index,name,compute_cap,memory.total,memory.used,driver_version"
PROCESS_QUERY = "pid,used_memory"
_NOT_A_VALUE = ("[n/a]", "[not supported]", "n/a", "")


class CheckError(Exception):
    """A fact the check needs that the machine's tools did not give; the message says which."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_cap: str | None  # "9.0"; None where nvidia-smi did not say
    memory_total_mib: int | None
    memory_used_mib: int | None
    driver: str | None


def _value(text: str) -> str | None:
    text = text.strip()
    return None if text.lower() in _NOT_A_VALUE else text


def _mib(text: str) -> int | None:
    value = _value(text)
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def parse_gpus(text: str) -> list[Gpu]:
    """The GPUs in ``nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits``'s
    answer; ``CheckError`` for an answer of another shape (an error message, an old driver
    that does not know ``compute_cap``)."""
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row or not "".join(row).strip():
            continue
        if len(row) != 6 or not row[0].strip().isdigit():
            raise CheckError(f"nvidia-smi did not answer the GPU query: {','.join(row)[:200]!r}")
        index, name, cap, total, used, driver = row
        gpus.append(
            Gpu(int(index), name.strip(), _cap(cap), _mib(total), _mib(used), _value(driver))
        )
    if not gpus:
        raise CheckError("nvidia-smi listed no GPU")
    return gpus


def _cap(text: str) -> str | None:
    value = _value(text)
    return value if value is not None and re.fullmatch(r"\d{1,2}\.\d", value) else None


def cuda_architectures(gpus: Iterable[Gpu]) -> list[str]:
    """CMAKE_CUDA_ARCHITECTURES for these GPUs, each once: compute capability 9.0 -> "90",
    12.0 -> "120"; ``CheckError`` when a GPU's capability is unknown (pass ``--arch``)."""
    archs = set()
    for gpu in gpus:
        if gpu.compute_cap is None:
            raise CheckError(
                f"nvidia-smi gave no compute capability for GPU {gpu.index} ({gpu.name}); "
                "pass --arch (90 for an H100/H200, 89 for an RTX 4090, 80 for an A100)"
            )
        major, minor = gpu.compute_cap.split(".")
        archs.add(int(major) * 10 + int(minor))
    return [str(a) for a in sorted(archs)]


def cmake_args(archs: Iterable[str], defines: Mapping[str, str] | None = None) -> list[str]:
    """The CMAKE_ARGS that build llama-cpp-python's llama.cpp with CUDA for ``archs`` only,
    without the multimodal library edgeinfer does not load (LLAVA_BUILD=OFF), plus
    ``defines`` (CMake cache entries such as a cuBLAS found outside the toolkit)."""
    archs = list(archs)
    if not archs or not all(re.fullmatch(r"\d{2,3}[af]?", a) for a in archs):
        raise CheckError(f"CUDA architectures must be like 90 or 89; got {archs!r}")
    args = ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}", "-DLLAVA_BUILD=OFF"]
    for key, value in (defines or {}).items():
        if re.search(r"\s", key + value):  # CMAKE_ARGS is split on whitespace
            raise CheckError(f"{key}={value!r}: a path with whitespace cannot go in CMAKE_ARGS")
        args.append(f"-D{key}={value}")
    return args


def parse_process_memory(text: str) -> dict[int, int]:
    """pid -> MiB from ``nvidia-smi --query-compute-apps=PROCESS_QUERY
    --format=csv,noheader,nounits`` (rows it cannot read are left out)."""
    found: dict[int, int] = {}
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) == 2 and row[0].strip().isdigit() and _mib(row[1]) is not None:
            found[int(row[0])] = found.get(int(row[0]), 0) + int(_mib(row[1]) or 0)
    return found


def parse_nvcc_version(text: str) -> str | None:
    """ "release 13.0" in ``nvcc --version``'s answer -> "13.0"."""
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def parse_offloaded(lines: Iterable[str]) -> tuple[int, int] | None:
    """(layers offloaded, layers) from llama.cpp's load log ("load_tensors: offloaded 31/31
    layers to GPU"), the last such line; None when the log has none (a CPU load)."""
    found = None
    for line in lines:
        match = _OFFLOADED.search(line)
        if match:
            found = (int(match.group(1)), int(match.group(2)))
    return found


# library -> the CMake cache entry FindCUDAToolkit fills for it
_LIBRARIES = {"cublas": "CUDA_cublas_LIBRARY", "cublasLt": "CUDA_cublasLt_LIBRARY",
              "cuda": "CUDA_cuda_driver_LIBRARY"}  # fmt: skip


def cuda_libraries(
    toolkit_dirs: Iterable[str],
    other_dirs: Iterable[str],
    listdir: Callable[[str], Iterable[str]],
) -> tuple[dict[str, str], list[str], list[str]]:
    """What CMake must be told about the CUDA libraries llama.cpp links: (cache entries for
    the libraries the toolkit's own folders lack but another folder has, the folders of those
    libraries (for LD_LIBRARY_PATH), the libraries found nowhere). ``toolkit_dirs``: where
    FindCUDAToolkit looks by itself (lib64, lib64/stubs, targets/*/lib); ``other_dirs``: the
    driver's folder, NVIDIA's pip packages' lib folders."""
    toolkit = [(d, set(listdir(d))) for d in toolkit_dirs]
    others = [(d, sorted(listdir(d))) for d in other_dirs]
    defines: dict[str, str] = {}
    folders: list[str] = []
    missing: list[str] = []
    for lib, entry in _LIBRARIES.items():
        if any(f"lib{lib}.so" in names for _, names in toolkit):
            continue
        pattern = re.compile(rf"lib{re.escape(lib)}\.so(\.\d+)*")
        hit = next(((d, n) for d, names in others for n in names if pattern.fullmatch(n)), None)
        if hit is None:
            missing.append(lib)
            continue
        defines[entry] = f"{hit[0].rstrip('/')}/{hit[1]}"
        if hit[0] not in folders:
            folders.append(hit[0])
    return defines, folders, missing


def cublas_include(
    toolkit_includes: Iterable[str], other_includes: Iterable[str],
    listdir: Callable[[str], Iterable[str]],
) -> str | None:  # fmt: skip
    """The folder holding ``cublas_v2.h`` when the toolkit's include folders lack it (for
    ``-DCMAKE_CUDA_FLAGS=-I...``); None when the toolkit has it or nothing does."""
    if any("cublas_v2.h" in set(listdir(d)) for d in toolkit_includes):
        return None
    return next((d for d in other_includes if "cublas_v2.h" in set(listdir(d))), None)
