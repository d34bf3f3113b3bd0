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

from ..errors import BackendUnavailableError, InvalidRequestError
from .inventory import DeviceInventory

__all__ = [
    "CPU_PROVIDER",
    "Candidate",
    "ProviderPlan",
    "Skipped",
    "normalise_device",
    "plan_providers",
]

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
    wish = normalise_device(preference)
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


def normalise_device(preference: str) -> str:
    """The wish a ``device`` argument names: one of ``PREFERENCES`` or an ONNX Runtime
    provider name; ``InvalidRequestError`` for anything else."""
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
    cpu = _llama_cpu(inv)
    if wish == "cpu":
        return [], [], cpu
    if wish in ("auto", "gpu", "cuda", "metal"):
        found, skipped = _llama_gpu(inv, wish)
    else:
        found, skipped = [], [_llama_elsewhere(inv, wish)]
    if wish == "auto" and not found:
        return [], skipped if inv.gpus else [], cpu  # a hint only where there is a GPU
    return found, skipped, cpu


def _llama_cpu(inv: DeviceInventory) -> Candidate:
    cpu = Candidate(
        LLAMA_CPU, "cpu", f"llama.cpp CPU kernels on {_cpu_summary(inv)}", {"n_gpu_layers": 0}
    )
    if "amx-int8" not in inv.cpu_features:
        return cpu
    # llama.cpp's AMX weight buffers crashed llama_decode (SIGSEGV) on a Xeon with AMX
    # (llama-cpp-python 0.3.36, Q4_1 weights): keep the weights in plain CPU buffers.
    return Candidate(
        cpu.provider,
        cpu.device,
        f"{cpu.reason}; AMX weight repacking off (it crashes llama.cpp on AMX CPUs)",
        {**cpu.options, "use_extra_bufts": False},
    )


def _llama_gpu(inv: DeviceInventory, wish: str) -> tuple[list[Candidate], list[Skipped]]:
    """The first GPU llama.cpp can offload to that meets ``wish``, or why there is none."""
    skipped: list[Skipped] = []
    gpus = inv.llama_gpus if inv.llama_gpu_offload else ()
    wanted_backend = {"cuda": "CUDA", "metal": "Metal"}.get(wish)
    for index, gpu in enumerate(gpus):
        if wanted_backend and gpu.backend != wanted_backend:
            skipped.append(
                Skipped(f"llama.cpp:{gpu.backend}", f"{gpu.name} is not {wanted_backend}")
            )
            continue
        memory = f", {gpu.memory_bytes / 2**30:.1f} GiB" if gpu.memory_bytes else ""
        device = {"Metal": "metal", "CUDA": "cuda"}.get(gpu.backend, "gpu")
        candidate = Candidate(
            f"llama.cpp:{gpu.backend or 'GPU'}",
            device,
            f"every layer offloaded to {gpu.name}{memory}",
            {"n_gpu_layers": -1, "main_gpu": index},
        )
        return [candidate], skipped
    return [], [*skipped, _llama_gpu_missing(inv, wanted_backend)]


def _llama_elsewhere(inv: DeviceInventory, wish: str) -> Skipped:
    """Why a wish llama.cpp cannot meet (an NPU, an ONNX Runtime provider) is left out."""
    if wish == "npu":
        npu = ", ".join(n.name for n in inv.npus) or "no NPU was found on this machine"
        return Skipped(
            "llama.cpp:NPU",
            f"llama.cpp has no NPU backend ({npu}); convert the model "
            "to ONNX (edgeinfer convert SRC -o OUT --to onnx) to run it on an NPU",
        )
    return Skipped(
        wish,
        "this is an ONNX Runtime provider, and GGUF models run on llama.cpp; convert "
        "the model to ONNX, or use device auto, cpu, cuda or metal",
    )


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


@dataclass(frozen=True)
class _Ort:
    """What every ONNX offer reads: the machine, the wish, the providers onnxruntime has."""

    inv: DeviceInventory
    wish: str
    have: frozenset[str]

    def offer(
        self, provider: str, device: str, reason: str, options: Mapping[str, Any] | None = None
    ) -> Candidate | Skipped:
        """A candidate if this onnxruntime has ``provider``, else why not and what to install."""
        if provider in self.have:
            return Candidate(provider, device, reason, dict(options or {}))
        return Skipped(
            provider,
            f"this onnxruntime ({self.inv.onnxruntime_version}) has no {provider}; "
            f"install {_ORT_INSTALL.get(provider, 'an onnxruntime build with it')}",
        )


def _onnx(inv: DeviceInventory, wish: str) -> tuple[list[Candidate], list[Skipped], Candidate]:
    if inv.onnxruntime_version is None:
        raise BackendUnavailableError("ONNX models need onnxruntime: pip install 'edgeinfer[onnx]'")
    cpu = Candidate(CPU_PROVIDER, "cpu", f"ONNX Runtime CPU on {_cpu_summary(inv)}")
    if wish == "cpu":
        return [], [], cpu
    ort = _Ort(inv, wish, frozenset(inv.ort_providers))
    if wish.lower().endswith("executionprovider"):  # a provider asked for by name
        provider = next((p for p in inv.ort_providers if p.lower() == wish.lower()), wish)
        if provider == CPU_PROVIDER:
            return [], [], cpu
        offers = [ort.offer(provider, _device_of(provider), "asked for by name")]
    else:  # in the order they are tried
        offers = [
            *_offer_nvidia(ort),
            *_offer_openvino_gpu(ort),
            *_offer_npus(ort),
            *_offer_apple(ort),
            *_offer_directml(ort),
        ]
    found = [o for o in offers if isinstance(o, Candidate)]
    skipped = [o for o in offers if isinstance(o, Skipped)]
    return found, skipped, cpu


def _offer_nvidia(ort: _Ort) -> list[Candidate | Skipped]:
    inv, wish, have = ort.inv, ort.wish, ort.have
    if wish not in ("auto", "cuda", "gpu"):
        return []
    if wish == "auto" and not inv.has_nvidia_gpu:
        if _CUDA in have:
            return [Skipped(_CUDA, "onnxruntime-gpu is installed but no NVIDIA GPU was found")]
        return []
    if wish == "gpu" and _CUDA not in have and not inv.has_nvidia_gpu:
        return []
    offers: list[Candidate | Skipped] = []
    if inv.platform == "jetson" and (wish != "auto" or _TRT in have):
        offers.append(
            ort.offer(
                _TRT,
                "cuda",
                f"Jetson ({inv.board}): TensorRT compiles the graph for the GPU; the "
                "engine is cached after the first load",
                {"trt_fp16_enable": True, "trt_engine_cache_enable": True},
            )
        )
    gpu = next((g.name for g in inv.gpus if g.vendor == "NVIDIA"), None)
    offers.append(ort.offer(_CUDA, "cuda", f"CUDA on {gpu or 'the NVIDIA GPU'}", {"device_id": 0}))
    if inv.platform != "jetson" and _TRT in have and wish == "auto":
        offers.append(
            Skipped(
                _TRT,
                "not chosen automatically off Jetson: building its engine takes "
                "minutes per model; ask for device='TensorrtExecutionProvider'",
            )
        )
    return offers


def _offer_openvino_gpu(ort: _Ort) -> list[Candidate | Skipped]:
    if ort.wish not in ("auto", "gpu") or _OPENVINO not in ort.have:
        return []
    if not any(d.startswith("GPU") for d in ort.inv.openvino_devices):
        return []
    reason = "Intel GPU through OpenVINO (dynamic shapes, so ahead of the NPU)"
    return [ort.offer(_OPENVINO, "gpu", reason, {"device_type": "GPU"})]


def _offer_npus(ort: _Ort) -> list[Candidate | Skipped]:
    inv, wish, have = ort.inv, ort.wish, ort.have
    if wish not in ("auto", "npu"):
        return []
    vendors = {n.vendor for n in inv.npus}
    offers: list[Candidate | Skipped] = []
    if _QNN in have or "Qualcomm" in vendors:
        library = "QnnHtp.dll" if inv.os == "windows" else "libQnnHtp.so"
        options = {
            "backend_path": library,
            "htp_performance_mode": "burst",
            "enable_htp_fp16_precision": "1",
        }
        offers.append(
            ort.offer(_QNN, "npu", "Qualcomm Hexagon NPU through QNN (HTP backend)", options)
        )
    intel_npu = "Intel" in vendors or any(d.startswith("NPU") for d in inv.openvino_devices)
    if (_OPENVINO in have and intel_npu) or ("Intel" in vendors and wish == "npu"):
        offers.append(
            ort.offer(_OPENVINO, "npu", "Intel NPU through OpenVINO", {"device_type": "NPU"})
        )
    if _VITIS in have or ("AMD" in vendors and wish == "npu"):
        offers.append(ort.offer(_VITIS, "npu", "AMD XDNA NPU through Vitis AI"))
    if inv.platform == "apple-silicon" and wish == "npu":
        options = {"MLComputeUnits": "CPUAndNeuralEngine", "ModelFormat": "MLProgram"}
        offers.append(ort.offer(_COREML, "npu", "Apple Neural Engine through CoreML", options))
    if wish == "npu" and not offers:
        offers.append(
            Skipped(
                "NPU",
                "no NPU was found on this machine (looked for Qualcomm "
                "Hexagon, Intel NPU, AMD XDNA, Apple Neural Engine)",
            )
        )
    return offers


def _offer_apple(ort: _Ort) -> list[Candidate | Skipped]:
    inv, wish = ort.inv, ort.wish
    if wish not in ("auto", "metal", "gpu"):
        return []
    if inv.platform == "apple-silicon":
        units = "ALL" if wish == "auto" else "CPUAndGPU"
        reason = "Apple Silicon: CoreML runs what it supports on the GPU" + (
            " and Neural Engine" if units == "ALL" else ""
        )
        return [
            ort.offer(
                _COREML, "metal", reason, {"MLComputeUnits": units, "ModelFormat": "MLProgram"}
            )
        ]
    if wish == "metal":
        why = f"Metal and CoreML need an Apple Silicon Mac; this is {inv.os}/{inv.arch}"
        return [Skipped(_COREML, why)]
    return []


def _offer_directml(ort: _Ort) -> list[Candidate | Skipped]:
    inv, wish = ort.inv, ort.wish
    if wish not in ("auto", "directml", "gpu"):
        return []
    if inv.os != "windows":
        return (
            [Skipped(_DML, f"DirectML is Windows only; this is {inv.os}")]
            if wish == "directml"
            else []
        )
    if wish != "auto" or _DML in ort.have:
        return [
            ort.offer(
                _DML, "directml", "Windows: DirectML runs on any DirectX 12 GPU", {"device_id": 0}
            )
        ]
    return []


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
