"""Which execution provider runs a model: a pure function of the machine, format and wish.

``plan_providers(inventory, model_format, preference)`` returns the candidates ``load()`` tries
in order, each with its provider options and a one-line reason, plus what was considered and
left out (and why). It reads nothing but its arguments, so the choice for a Jetson or a
Snapdragon laptop is tested here from their recorded inventories.

ONNX models run on ONNX Runtime execution providers; GGUF models run on llama.cpp, whose GPU
backend (CUDA, Metal, Vulkan, ...) is fixed when llama-cpp-python is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import BackendUnavailableError, InvalidRequestError
from .inventory import DeviceInventory

__all__ = ["CPU_PROVIDER", "Candidate", "ProviderPlan", "Skipped", "plan_providers"]

CPU_PROVIDER = "CPUExecutionProvider"
LLAMA_CPU = "llama.cpp:CPU"
PREFERENCES = ("auto", "cpu", "cuda", "metal", "npu", "gpu", "directml")

_CUDA = "CUDAExecutionProvider"
_TRT = "TensorrtExecutionProvider"
_COREML = "CoreMLExecutionProvider"
_QNN = "QNNExecutionProvider"
_OPENVINO = "OpenVINOExecutionProvider"
_VITIS = "VitisAIExecutionProvider"
_DML = "DmlExecutionProvider"

# What to install for a provider that this onnxruntime does not have.
_ORT_INSTALL = {
    _CUDA: "onnxruntime-gpu (pip uninstall onnxruntime && pip install onnxruntime-gpu), with "
    "the CUDA 12 runtime and cuDNN 9",
    _TRT: "onnxruntime-gpu and TensorRT 10 (on Jetson: the onnxruntime-gpu wheel for your "
    "JetPack release)",
    _COREML: "the macOS build of onnxruntime (pip install onnxruntime on an Apple Silicon Mac)",
    _QNN: "onnxruntime-qnn (pip install onnxruntime-qnn), on a Snapdragon machine",
    _OPENVINO: "onnxruntime-openvino (pip install onnxruntime-openvino openvino)",
    _VITIS: "AMD's Ryzen AI Software, whose onnxruntime has the VitisAI provider",
    _DML: "onnxruntime-directml (pip install onnxruntime-directml), on Windows",
    "ROCMExecutionProvider": "onnxruntime-rocm",
    "MIGraphXExecutionProvider": "onnxruntime-migraphx",
}
_LLAMA_INSTALL = {
    "CUDA": "CMAKE_ARGS='-DGGML_CUDA=on' pip install --force-reinstall --no-cache-dir "
    "llama-cpp-python",
    "Metal": "CMAKE_ARGS='-DGGML_METAL=on' pip install --force-reinstall --no-cache-dir "
    "llama-cpp-python",
}


@dataclass(frozen=True)
class Candidate:
    """One way to run the model: a provider, its options and why it is on the list."""

    provider: str  # an ONNX Runtime provider name, or "llama.cpp:<backend>"
    device: str  # "cpu" | "cuda" | "metal" | "npu" | "gpu" | "directml"
    reason: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Skipped:
    """A provider that was considered and left out, and why."""

    provider: str
    reason: str


@dataclass(frozen=True)
class ProviderPlan:
    model_format: str
    preference: str
    candidates: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_format": self.model_format,
            "preference": self.preference,
            "candidates": [
                {
                    "provider": c.provider,
                    "device": c.device,
                    "options": dict(c.options),
                    "reason": c.reason,
                }
                for c in self.candidates
            ],
            "skipped": [{"provider": s.provider, "reason": s.reason} for s in self.skipped],
        }

    def describe(self) -> list[str]:
        """Human-readable lines, candidates in order, then what was left out."""
        lines = [f"{i}. {c.provider}: {c.reason}" for i, c in enumerate(self.candidates, 1)]
        lines += [f"-  {s.provider} (not used): {s.reason}" for s in self.skipped]
        return lines


def plan_providers(
    inventory: DeviceInventory,
    model_format: str,
    preference: str = "auto",
    *,
    allow_fallback: bool = False,
) -> ProviderPlan:
    """Ordered candidates for running a ``model_format`` model on ``inventory``'s machine.

    ``preference`` is "auto", "cpu", "cuda", "metal", "npu", "gpu", "directml" or an ONNX
    Runtime provider name. A preference the machine cannot meet raises
    ``BackendUnavailableError`` naming what to install, unless ``allow_fallback`` is set; then
    the CPU follows, and the plan records why the preference was not met. "auto" always ends
    with the CPU.
    """
    if not isinstance(preference, str) or not preference.strip():
        raise InvalidRequestError(f"device={preference!r} is invalid: expected a name")
    wish = _normalise(preference)
    if model_format == "gguf":
        found, skipped, cpu = _gguf(inventory, wish)
    elif model_format == "onnx":
        found, skipped, cpu = _onnx(inventory, wish)
    else:
        raise BackendUnavailableError(f"no provider runs {model_format!r} models")
    if wish in ("auto", "cpu"):
        return ProviderPlan(model_format, preference, (*found, cpu), tuple(skipped))
    if not found and not allow_fallback:
        why = (
            "; ".join(f"{s.provider}: {s.reason}" for s in skipped)
            or "nothing on this machine provides it"
        )
        raise BackendUnavailableError(
            f"device={preference!r} is not available for this {model_format.upper()} model: "
            f"{why}. Or pass allow_fallback=True (--allow-fallback) to run on the CPU instead."
        )
    if allow_fallback:
        note = "fallback: " + (
            "after the providers above" if found else f"{preference} is not available"
        )
        cpu = Candidate(cpu.provider, "cpu", f"{note}; {cpu.reason}", cpu.options)
        return ProviderPlan(model_format, preference, (*found, cpu), tuple(skipped))
    return ProviderPlan(model_format, preference, tuple(found), tuple(skipped))


def _normalise(preference: str) -> str:
    wish = preference.strip()
    lowered = wish.lower()
    if lowered in PREFERENCES:
        return lowered
    if lowered in ("dml", "directml"):
        return "directml"
    if lowered == CPU_PROVIDER.lower():
        return "cpu"
    if lowered.endswith("executionprovider"):
        return wish
    raise InvalidRequestError(
        f"device={preference!r} is not known; use {', '.join(PREFERENCES)} or an ONNX Runtime "
        "provider name such as CUDAExecutionProvider"
    )


def _cpu_summary(inv: DeviceInventory) -> str:
    features = "/".join(
        f for f in inv.cpu_features if f in ("avx2", "avx512f", "neon", "dotprod", "i8mm", "amx")
    )
    cores = f"{inv.physical_cores} cores"
    return f"{inv.cpu_model}, {cores}" + (f", {features}" if features else "")


# --- GGUF: llama.cpp -------------------------------------------------------------------------


def _gguf(inv: DeviceInventory, wish: str) -> tuple[list[Candidate], list[Skipped], Candidate]:
    if inv.llama_cpp_version is None:
        raise BackendUnavailableError(
            "GGUF models need llama-cpp-python: pip install 'edgeinfer[gguf]'"
        )
    cpu = Candidate(
        LLAMA_CPU, "cpu", f"llama.cpp CPU kernels on {_cpu_summary(inv)}", {"n_gpu_layers": 0}
    )
    if "amx-int8" in inv.cpu_features:
        # llama.cpp's AMX weight buffers crashed llama_decode (SIGSEGV) on a Xeon with AMX
        # (llama-cpp-python 0.3.36, Q4_1 weights): keep the weights in plain CPU buffers.
        cpu = Candidate(
            cpu.provider,
            cpu.device,
            f"{cpu.reason}; AMX weight repacking off (it crashes llama.cpp on AMX CPUs)",
            {**cpu.options, "use_extra_bufts": False},
        )
    if wish == "cpu":
        return [], [], cpu
    found: list[Candidate] = []
    skipped: list[Skipped] = []
    gpus = inv.llama_gpus if inv.llama_gpu_offload else ()
    wanted_backend = {"cuda": "CUDA", "metal": "Metal"}.get(wish)
    if wish in ("auto", "gpu", "cuda", "metal"):
        for index, gpu in enumerate(gpus):
            if wanted_backend and gpu.backend != wanted_backend:
                skipped.append(
                    Skipped(f"llama.cpp:{gpu.backend}", f"{gpu.name} is not {wanted_backend}")
                )
                continue
            memory = f", {gpu.memory_bytes / 2**30:.1f} GiB" if gpu.memory_bytes else ""
            found.append(
                Candidate(
                    f"llama.cpp:{gpu.backend or 'GPU'}",
                    "metal"
                    if gpu.backend == "Metal"
                    else "cuda"
                    if gpu.backend == "CUDA"
                    else "gpu",
                    f"every layer offloaded to {gpu.name}{memory}",
                    {"n_gpu_layers": -1, "main_gpu": index},
                )
            )
            break
        if not found:
            skipped.append(_llama_gpu_missing(inv, wanted_backend))
    elif wish == "npu":
        npu = ", ".join(n.name for n in inv.npus) or "no NPU was found on this machine"
        skipped.append(
            Skipped(
                "llama.cpp:NPU",
                f"llama.cpp has no NPU backend ({npu}); convert the model "
                "to ONNX (edgeinfer convert SRC -o OUT --to onnx) to run it on an NPU",
            )
        )
    else:
        skipped.append(
            Skipped(
                wish,
                "this is an ONNX Runtime provider, and GGUF models run on llama.cpp; convert "
                "the model to ONNX, or use device auto, cpu, cuda or metal",
            )
        )
    if wish == "auto" and not found:
        return [], skipped if inv.gpus else [], cpu  # a hint only where there is a GPU
    return found, skipped, cpu


def _llama_gpu_missing(inv: DeviceInventory, backend: str | None) -> Skipped:
    hardware = ", ".join(g.name for g in inv.gpus)
    if backend is None:
        backend = (
            "Metal" if inv.platform == "apple-silicon" else "CUDA" if inv.has_nvidia_gpu else ""
        )
    name = f"llama.cpp:{backend or 'GPU'}"
    if inv.llama_gpu_offload and inv.llama_gpus:
        have = ", ".join(g.name for g in inv.llama_gpus)
        return Skipped(
            name,
            f"this llama-cpp-python drives {have}, not {backend}; reinstall it: "
            f"{_LLAMA_INSTALL.get(backend, 'with the matching GGML_* CMake flag')}",
        )
    what = f" for {hardware}" if hardware else ""
    if backend in _LLAMA_INSTALL and (
        hardware or (backend == "Metal" and inv.platform == "apple-silicon")
    ):
        return Skipped(
            name,
            f"this llama-cpp-python was built without GPU offload; to use "
            f"it{what}: {_LLAMA_INSTALL[backend]}",
        )
    if backend == "Metal":
        return Skipped(name, f"Metal needs an Apple Silicon Mac; this is {inv.os}/{inv.arch}")
    return Skipped(
        name,
        "no GPU was found and this llama-cpp-python has no GPU offload "
        f"(for NVIDIA: {_LLAMA_INSTALL['CUDA']})",
    )


# --- ONNX: ONNX Runtime execution providers --------------------------------------------------


def _onnx(inv: DeviceInventory, wish: str) -> tuple[list[Candidate], list[Skipped], Candidate]:
    if inv.onnxruntime_version is None:
        raise BackendUnavailableError("ONNX models need onnxruntime: pip install 'edgeinfer[onnx]'")
    cpu = Candidate(CPU_PROVIDER, "cpu", f"ONNX Runtime CPU on {_cpu_summary(inv)}")
    if wish == "cpu":
        return [], [], cpu
    have = set(inv.ort_providers)
    found: list[Candidate] = []
    skipped: list[Skipped] = []

    def offer(
        provider: str, device: str, reason: str, options: Mapping[str, Any] | None = None
    ) -> None:
        if provider in have:
            found.append(Candidate(provider, device, reason, dict(options or {})))
        else:
            skipped.append(
                Skipped(
                    provider,
                    f"this onnxruntime ({inv.onnxruntime_version}) has no {provider}; "
                    f"install {_ORT_INSTALL.get(provider, 'an onnxruntime build with it')}",
                )
            )

    if wish in ("auto", "cuda", "gpu"):
        _offer_nvidia(inv, wish, have, offer, skipped)
    if (
        wish in ("auto", "gpu")
        and _OPENVINO in have
        and any(d.startswith("GPU") for d in inv.openvino_devices)
    ):
        offer(
            _OPENVINO,
            "gpu",
            "Intel GPU through OpenVINO (dynamic shapes, so ahead of the NPU)",
            {"device_type": "GPU"},
        )
    if wish in ("auto", "npu"):
        _offer_npus(inv, wish, have, offer, skipped)
    if wish in ("auto", "metal", "gpu"):
        if inv.platform == "apple-silicon":
            units = "ALL" if wish == "auto" else "CPUAndGPU"
            offer(
                _COREML,
                "metal",
                "Apple Silicon: CoreML runs what it supports on the GPU"
                + (" and Neural Engine" if units == "ALL" else ""),
                {"MLComputeUnits": units, "ModelFormat": "MLProgram"},
            )
        elif wish == "metal":
            skipped.append(
                Skipped(
                    _COREML,
                    f"Metal and CoreML need an Apple Silicon Mac; this is {inv.os}/{inv.arch}",
                )
            )
    if wish in ("auto", "directml", "gpu"):
        if inv.os == "windows":
            if wish != "auto" or _DML in have:
                offer(
                    _DML,
                    "directml",
                    "Windows: DirectML runs on any DirectX 12 GPU",
                    {"device_id": 0},
                )
        elif wish == "directml":
            skipped.append(Skipped(_DML, f"DirectML is Windows only; this is {inv.os}"))
    if wish.lower().endswith("executionprovider"):
        provider = next((p for p in inv.ort_providers if p.lower() == wish.lower()), wish)
        if provider == CPU_PROVIDER:
            return [], [], cpu
        offer(provider, _device_of(provider), "asked for by name")
    return found, skipped, cpu


def _offer_nvidia(
    inv: DeviceInventory, wish: str, have: set[str], offer: Any, skipped: list[Skipped]
) -> None:
    gpu = next((g.name for g in inv.gpus if g.vendor == "NVIDIA"), None)
    if wish == "auto" and not inv.has_nvidia_gpu:
        if _CUDA in have:
            skipped.append(
                Skipped(_CUDA, "onnxruntime-gpu is installed but no NVIDIA GPU was found")
            )
        return
    if wish == "gpu" and _CUDA not in have and not inv.has_nvidia_gpu:
        return
    if inv.platform == "jetson" and (wish != "auto" or _TRT in have):
        offer(
            _TRT,
            "cuda",
            f"Jetson ({inv.board}): TensorRT compiles the graph for the GPU; the "
            "engine is cached after the first load",
            {"trt_fp16_enable": True, "trt_engine_cache_enable": True},
        )
    target = gpu or "the NVIDIA GPU"
    offer(_CUDA, "cuda", f"CUDA on {target}", {"device_id": 0})
    if inv.platform != "jetson" and _TRT in have and wish == "auto":
        skipped.append(
            Skipped(
                _TRT,
                "not chosen automatically off Jetson: building its engine takes "
                "minutes per model; ask for device='TensorrtExecutionProvider'",
            )
        )


def _offer_npus(
    inv: DeviceInventory, wish: str, have: set[str], offer: Any, skipped: list[Skipped]
) -> None:
    vendors = {n.vendor for n in inv.npus}
    tried = False
    if _QNN in have or "Qualcomm" in vendors:
        tried = True
        library = "QnnHtp.dll" if inv.os == "windows" else "libQnnHtp.so"
        offer(
            _QNN,
            "npu",
            "Qualcomm Hexagon NPU through QNN (HTP backend)",
            {
                "backend_path": library,
                "htp_performance_mode": "burst",
                "enable_htp_fp16_precision": "1",
            },
        )
    if _OPENVINO in have and (
        "Intel" in vendors or any(d.startswith("NPU") for d in inv.openvino_devices)
    ):
        tried = True
        offer(_OPENVINO, "npu", "Intel NPU through OpenVINO", {"device_type": "NPU"})
    elif "Intel" in vendors and wish == "npu":
        tried = True
        offer(_OPENVINO, "npu", "Intel NPU through OpenVINO", {"device_type": "NPU"})
    if _VITIS in have or ("AMD" in vendors and wish == "npu"):
        tried = True
        offer(_VITIS, "npu", "AMD XDNA NPU through Vitis AI")
    if inv.platform == "apple-silicon" and wish == "npu":
        tried = True
        offer(
            _COREML,
            "npu",
            "Apple Neural Engine through CoreML",
            {"MLComputeUnits": "CPUAndNeuralEngine", "ModelFormat": "MLProgram"},
        )
    if wish == "npu" and not tried:
        skipped.append(
            Skipped(
                "NPU",
                "no NPU was found on this machine (looked for Qualcomm "
                "Hexagon, Intel NPU, AMD XDNA, Apple Neural Engine)",
            )
        )


def _device_of(provider: str) -> str:
    return {
        _CUDA: "cuda",
        _TRT: "cuda",
        _COREML: "metal",
        _QNN: "npu",
        _VITIS: "npu",
        _DML: "directml",
        _OPENVINO: "cpu",
    }.get(provider, "gpu")
