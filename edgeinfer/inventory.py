"""What this machine has: CPU, memory, accelerators and the engines' view of them.

``devices()`` reads the machine once per process and caches the result. Every fact comes
through a ``Probe`` — files such as ``/proc/cpuinfo`` and ``/proc/device-tree/model``,
``sysctl`` on macOS, the registry on Windows, onnxruntime's provider list, llama.cpp's device
list — and ``build_inventory`` turns those facts into a ``DeviceInventory``. Tests feed the
same function the facts recorded on real boards (``RecordedProbe``), so the parsing that runs
on a Raspberry Pi or a Jetson is the parsing under test here.

Reading the inventory never imports torch and never opens a network connection; the engines
are imported only if they are installed.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

__all__ = [
    "Accelerator",
    "DeviceInventory",
    "MachineProbe",
    "Probe",
    "RecordedProbe",
    "RecordingProbe",
    "build_inventory",
    "devices",
]

logger = logging.getLogger(__name__)

# llama.cpp's ggml_backend_dev_type enum.
_GGML_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}

# x86 flags from /proc/cpuinfo worth reporting, by the name edgeinfer prints.
_X86_FEATURES = {
    "sse4_2": "sse4.2",
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx_vnni": "avx-vnni",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512_vnni": "avx512-vnni",
    "avx512_bf16": "avx512-bf16",
    "amx_tile": "amx",
    "amx_int8": "amx-int8",
    "amx_bf16": "amx-bf16",
}
# ARM "Features" from /proc/cpuinfo (Linux kernel names).
_ARM_FEATURES = {
    "asimd": "neon",
    "asimdhp": "fp16",
    "asimddp": "dotprod",
    "i8mm": "i8mm",
    "bf16": "bf16",
    "sve": "sve",
    "sve2": "sve2",
}
# macOS sysctl hw.optional.* keys on Apple Silicon.
_MAC_ARM_FEATURES = {
    "hw.optional.neon": "neon",
    "hw.optional.arm.FEAT_FP16": "fp16",
    "hw.optional.arm.FEAT_DotProd": "dotprod",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16",
}
# Windows IsProcessorFeaturePresent constants (winnt.h).
_WINDOWS_FEATURES = {
    19: "neon",  # PF_ARM_NEON_INSTRUCTIONS_AVAILABLE
    39: "avx",  # PF_AVX_INSTRUCTIONS_AVAILABLE
    40: "avx2",  # PF_AVX2_INSTRUCTIONS_AVAILABLE
    41: "avx512f",  # PF_AVX512F_INSTRUCTIONS_AVAILABLE
    43: "dotprod",  # PF_ARM_V82_DP_INSTRUCTIONS_AVAILABLE
}
# ARM "CPU part" numbers (implementer 0x41, Arm Ltd) for boards whose cpuinfo has no name.
_ARM_CORES = {
    "0xd03": "Cortex-A53",
    "0xd07": "Cortex-A57",
    "0xd08": "Cortex-A72",
    "0xd0b": "Cortex-A76",
    "0xd0c": "Neoverse-N1",
    "0xd40": "Neoverse-V1",
    "0xd41": "Cortex-A78",
    "0xd42": "Cortex-A78AE",
    "0xd4f": "Neoverse-V2",
}
_PCI_VENDORS = {"0x10de": "NVIDIA", "0x8086": "Intel", "0x1002": "AMD"}
_ACCEL_DRIVERS = {"intel_vpu": "Intel NPU", "amdxdna": "AMD XDNA NPU", "qaic": "Qualcomm AI 100"}


@dataclass(frozen=True)
class Accelerator:
    """A GPU or NPU, as one source reported it."""

    name: str
    kind: str  # "gpu" | "igpu" | "npu" | "accel"
    vendor: str = ""
    backend: str = ""  # the engine backend that drives it: "CUDA", "Metal", "Vulkan", ...
    memory_bytes: int | None = None  # total; shared with the host for integrated devices
    source: str = ""


@dataclass(frozen=True)
class DeviceInventory:
    """One machine's compute resources, as edgeinfer sees them."""

    os: str  # "linux" | "darwin" | "windows"
    os_release: str
    arch: str  # "x86_64" | "arm64"
    platform: str  # "raspberry-pi" | "jetson" | "apple-silicon" | "windows" | "linux" | "macos"
    board: str | None
    cpu_model: str
    physical_cores: int
    logical_cores: int
    cpu_features: tuple[str, ...]
    total_ram: int
    available_ram: int
    onnxruntime_version: str | None = None  # None: not installed (or not asked for)
    ort_providers: tuple[str, ...] = ()
    llama_cpp_version: str | None = None  # None: not installed (or not asked for)
    llama_gpu_offload: bool = False
    llama_devices: tuple[Accelerator, ...] = ()
    gpus: tuple[Accelerator, ...] = ()
    npus: tuple[Accelerator, ...] = ()
    openvino_devices: tuple[str, ...] = ()

    @property
    def llama_gpus(self) -> tuple[Accelerator, ...]:
        """llama.cpp devices a model can be offloaded to (GPUs and integrated GPUs)."""
        return tuple(d for d in self.llama_devices if d.kind in ("gpu", "igpu"))

    @property
    def has_nvidia_gpu(self) -> bool:
        return self.platform == "jetson" or any(g.vendor == "NVIDIA" for g in self.gpus)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceInventory:
        values = dict(data)
        for key in ("llama_devices", "gpus", "npus"):
            values[key] = tuple(Accelerator(**a) for a in values.get(key, ()))
        for key in ("cpu_features", "ort_providers", "openvino_devices"):
            values[key] = tuple(values.get(key, ()))
        return cls(**values)


class Probe(Protocol):
    """Where facts about a machine come from."""

    def system(self) -> str: ...  # platform.system(): "Linux", "Darwin", "Windows"
    def machine(self) -> str: ...  # platform.machine()
    def release(self) -> str: ...
    def read(self, path: str) -> str | None: ...
    def listdir(self, path: str) -> list[str]: ...
    def sysctl(self, name: str) -> str | None: ...
    def windows_cpu(self) -> tuple[str, list[str]]: ...  # processor name, feature names
    def memory(self) -> tuple[int, int]: ...  # total, available bytes
    def cores(self) -> tuple[int, int]: ...  # physical, logical
    def nvidia_smi(self) -> str | None: ...  # "name, MiB" lines
    def onnxruntime(self) -> tuple[str, list[str]] | None: ...  # version, providers
    def llama_cpp(self) -> tuple[str, bool, list[Accelerator]] | None: ...
    def openvino_devices(self) -> list[str] | None: ...


class MachineProbe:
    """Facts read from the machine this process runs on."""

    def system(self) -> str:
        return platform.system()

    def machine(self) -> str:
        return platform.machine()

    def release(self) -> str:
        return platform.release()

    def read(self, path: str) -> str | None:
        try:
            return Path(path).read_bytes().decode("utf-8", "replace")
        except OSError:
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    def sysctl(self, name: str) -> str | None:
        return _command(["sysctl", "-n", name])

    def windows_cpu(self) -> tuple[str, list[str]]:
        name = platform.processor()
        try:
            import winreg  # type: ignore[import-not-found,unused-ignore]

            key = winreg.OpenKey(  # type: ignore[attr-defined,unused-ignore]
                winreg.HKEY_LOCAL_MACHINE,  # type: ignore[attr-defined,unused-ignore]
                r"HARDWARE\DESCRIPTION\System\CentralProcessor\0",
            )
            name = str(winreg.QueryValueEx(key, "ProcessorNameString")[0]).strip()  # type: ignore[attr-defined,unused-ignore]
        except (ImportError, OSError):
            pass
        features: list[str] = []
        try:
            present = ctypes.windll.kernel32.IsProcessorFeaturePresent  # type: ignore[attr-defined,unused-ignore]
            features = [n for code, n in _WINDOWS_FEATURES.items() if present(code)]
        except (AttributeError, OSError):
            pass
        return name, features

    def memory(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)

    def cores(self) -> tuple[int, int]:
        logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
        return psutil.cpu_count(logical=False) or logical, logical

    def nvidia_smi(self) -> str | None:
        if shutil.which("nvidia-smi") is None:
            return None
        return _command(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
        )

    def onnxruntime(self) -> tuple[str, list[str]] | None:
        if importlib.util.find_spec("onnxruntime") is None:
            return None
        try:
            import onnxruntime
        except Exception as exc:  # a broken install must not break the inventory
            logger.debug("onnxruntime is installed but does not import: %s", exc)
            return None
        return str(onnxruntime.__version__), list(onnxruntime.get_available_providers())

    def llama_cpp(self) -> tuple[str, bool, list[Accelerator]] | None:
        if importlib.util.find_spec("llama_cpp") is None:
            return None
        try:
            import llama_cpp
        except Exception as exc:
            logger.debug("llama-cpp-python is installed but does not import: %s", exc)
            return None
        offload = bool(llama_cpp.llama_supports_gpu_offload())
        return str(getattr(llama_cpp, "__version__", "unknown")), offload, _ggml_devices(llama_cpp)

    def openvino_devices(self) -> list[str] | None:
        if importlib.util.find_spec("openvino") is None:
            return None
        try:
            import openvino  # type: ignore[import-not-found,unused-ignore]

            return [str(d) for d in openvino.Core().available_devices]
        except Exception as exc:
            logger.debug("openvino did not list its devices: %s", exc)
            return None


class RecordingProbe:
    """Wraps a probe and writes down every fact it hands out, in ``RecordedProbe``'s format:
    ``edgeinfer devices --record FILE`` captures a real machine for the tests this way."""

    def __init__(self, inner: Probe) -> None:
        self._inner = inner
        self.record: dict[str, Any] = {"files": {}, "sysctl": {}}

    def _keep(self, key: str, value: Any) -> Any:
        self.record[key] = value
        return value

    def system(self) -> str:
        return str(self._keep("system", self._inner.system()))

    def machine(self) -> str:
        return str(self._keep("machine", self._inner.machine()))

    def release(self) -> str:
        return str(self._keep("release", self._inner.release()))

    def read(self, path: str) -> str | None:
        value = self._inner.read(path)
        self.record["files"][path] = value  # None too: replayed listings stay the same
        return value

    def listdir(self, path: str) -> list[str]:
        return self._inner.listdir(path)  # replayed from the paths read under it

    def sysctl(self, name: str) -> str | None:
        value = self._inner.sysctl(name)
        self.record["sysctl"][name] = value
        return value

    def windows_cpu(self) -> tuple[str, list[str]]:
        name, features = self._inner.windows_cpu()
        self.record["windows_cpu"] = {"name": name, "features": list(features)}
        return name, features

    def memory(self) -> tuple[int, int]:
        total, available = self._inner.memory()
        self.record["memory"] = {"total": total, "available": available}
        return total, available

    def cores(self) -> tuple[int, int]:
        physical, logical = self._inner.cores()
        self.record["cores"] = {"physical": physical, "logical": logical}
        return physical, logical

    def nvidia_smi(self) -> str | None:
        value = self._inner.nvidia_smi()
        return None if value is None else str(self._keep("nvidia_smi", value))

    def onnxruntime(self) -> tuple[str, list[str]] | None:
        value = self._inner.onnxruntime()
        if value is not None:
            self.record["onnxruntime"] = {"version": value[0], "providers": list(value[1])}
        return value

    def llama_cpp(self) -> tuple[str, bool, list[Accelerator]] | None:
        value = self._inner.llama_cpp()
        if value is not None:
            devices = [{k: v for k, v in asdict(d).items() if k != "source"} for d in value[2]]
            self.record["llama_cpp"] = {
                "version": value[0], "gpu_offload": value[1], "devices": devices
            }  # fmt: skip
        return value

    def openvino_devices(self) -> list[str] | None:
        value = self._inner.openvino_devices()
        if value is not None:
            self.record["openvino_devices"] = list(value)
        return value


class RecordedProbe:
    """Facts recorded on another machine (a JSON object), for tests and ``--inventory``."""

    def __init__(self, record: Mapping[str, Any]) -> None:
        self._r = record

    def system(self) -> str:
        return str(self._r["system"])

    def machine(self) -> str:
        return str(self._r["machine"])

    def release(self) -> str:
        return str(self._r.get("release", ""))

    def read(self, path: str) -> str | None:
        value = self._r.get("files", {}).get(path)
        return None if value is None else str(value)

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        names = {
            p[len(prefix) :].split("/", 1)[0]
            for p in self._r.get("files", {})
            if p.startswith(prefix)
        }
        return sorted(names)

    def sysctl(self, name: str) -> str | None:
        value = self._r.get("sysctl", {}).get(name)
        return None if value is None else str(value)

    def windows_cpu(self) -> tuple[str, list[str]]:
        cpu = self._r.get("windows_cpu", {})
        return str(cpu.get("name", "")), list(cpu.get("features", []))

    def memory(self) -> tuple[int, int]:
        total = int(self._r["memory"]["total"])
        return total, int(self._r["memory"].get("available", total))

    def cores(self) -> tuple[int, int]:
        return int(self._r["cores"]["physical"]), int(self._r["cores"]["logical"])

    def nvidia_smi(self) -> str | None:
        value = self._r.get("nvidia_smi")
        return None if value is None else str(value)

    def onnxruntime(self) -> tuple[str, list[str]] | None:
        ort = self._r.get("onnxruntime")
        return None if ort is None else (str(ort["version"]), list(ort["providers"]))

    def llama_cpp(self) -> tuple[str, bool, list[Accelerator]] | None:
        llama = self._r.get("llama_cpp")
        if llama is None:
            return None
        devices = [Accelerator(source="llama.cpp", **d) for d in llama.get("devices", [])]
        return str(llama["version"]), bool(llama["gpu_offload"]), devices

    def openvino_devices(self) -> list[str] | None:
        value = self._r.get("openvino_devices")
        return None if value is None else list(value)


ENGINES = ("onnxruntime", "llama_cpp")


def devices(engines: Iterable[str] = ENGINES) -> DeviceInventory:
    """This machine's inventory, read once per process.

    ``engines`` limits which engines are asked for their devices (``load()`` asks only the
    one its model needs: importing onnxruntime costs ~20 MB that a GGUF model does not need);
    an engine not asked for reads as not installed.
    """
    return _read(frozenset(engines))


@functools.cache
def _read(engines: frozenset[str]) -> DeviceInventory:
    inventory = build_inventory(MachineProbe(), engines=engines)
    logger.debug("device inventory: %s", inventory)
    return inventory


def build_inventory(probe: Probe, *, engines: Iterable[str] = ENGINES) -> DeviceInventory:
    """Turn a probe's raw facts into a ``DeviceInventory``."""
    engines = frozenset(engines)
    system = probe.system().lower()
    arch = _normalise_arch(probe.machine())
    total, available = probe.memory()
    physical, logical = probe.cores()
    cpu_model, features = _cpu(probe, system)
    board = _board(probe, system)
    platform_name = _platform(system, arch, board, probe)
    if platform_name == "jetson":
        release = _l4t_release(probe.read("/etc/nv_tegra_release") or "")
        if release:
            board = f"{board or 'NVIDIA Jetson'} (L4T {release})"

    ort = probe.onnxruntime() if "onnxruntime" in engines else None
    llama = probe.llama_cpp() if "llama_cpp" in engines else None
    openvino = probe.openvino_devices() if ort and "OpenVINOExecutionProvider" in ort[1] else None
    gpus = _gpus(probe, platform_name, cpu_model, total)
    npus = _npus(probe, platform_name, cpu_model, openvino or [])
    return DeviceInventory(
        os=system,
        os_release=probe.release(),
        arch=arch,
        platform=platform_name,
        board=board,
        cpu_model=cpu_model,
        physical_cores=physical,
        logical_cores=logical,
        cpu_features=tuple(features),
        total_ram=total,
        available_ram=available,
        onnxruntime_version=ort[0] if ort else None,
        ort_providers=tuple(ort[1]) if ort else (),
        llama_cpp_version=llama[0] if llama else None,
        llama_gpu_offload=llama[1] if llama else False,
        llama_devices=tuple(llama[2]) if llama else (),
        gpus=tuple(gpus),
        npus=tuple(npus),
        openvino_devices=tuple(openvino or ()),
    )


def _l4t_release(text: str) -> str | None:
    """ "# R36 (release), REVISION: 4.0, ..." -> "R36.4.0"."""
    first = text.splitlines()[0] if text else ""
    major = first.lstrip("# ").split(" ", 1)[0]
    _, _, rest = first.partition("REVISION:")
    revision = rest.split(",", 1)[0].strip()
    if not major.startswith("R"):
        return None
    return f"{major}.{revision}" if revision else major


def _normalise_arch(machine: str) -> str:
    m = machine.lower()
    if m in ("x86_64", "amd64", "x64"):
        return "x86_64"
    if m in ("aarch64", "arm64", "armv8l"):
        return "arm64"
    return m


def _cpu(probe: Probe, system: str) -> tuple[str, list[str]]:
    if system == "linux":
        return _parse_cpuinfo(probe.read("/proc/cpuinfo") or "")
    if system == "darwin":
        name = probe.sysctl("machdep.cpu.brand_string") or "unknown CPU"
        if probe.sysctl("hw.optional.arm64") == "1":
            feats = [n for key, n in _MAC_ARM_FEATURES.items() if probe.sysctl(key) == "1"]
        else:
            flags = " ".join(
                probe.sysctl(k) or ""
                for k in ("machdep.cpu.features", "machdep.cpu.leaf7_features")
            ).lower()
            feats = _x86_features(flags.replace(".", "_").split())
        return name.strip(), feats
    if system == "windows":
        return probe.windows_cpu()
    return platform.processor() or "unknown CPU", []


def _parse_cpuinfo(text: str) -> tuple[str, list[str]]:
    """CPU name and features from Linux /proc/cpuinfo, x86 or ARM."""
    fields: dict[str, str] = {}
    parts: list[str] = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        fields.setdefault(key, value)
        if key == "cpu part":
            parts.append(value.lower())
    if "flags" in fields:  # x86
        return fields.get("model name", "unknown x86 CPU"), _x86_features(fields["flags"].split())
    names = [_ARM_CORES.get(p, f"ARM core {p}") for p in dict.fromkeys(parts)]
    name = fields.get("model name") or (" + ".join(names) if names else "unknown ARM CPU")
    flags = fields.get("features", "").split()
    return name, [_ARM_FEATURES[f] for f in _ARM_FEATURES if f in flags]


def _x86_features(flags: list[str]) -> list[str]:
    present = set(flags)
    return [name for flag, name in _X86_FEATURES.items() if flag in present]


def _board(probe: Probe, system: str) -> str | None:
    if system != "linux":
        return None
    model = probe.read("/proc/device-tree/model") or probe.read(
        "/sys/firmware/devicetree/base/model"
    )
    if model:
        return model.replace("\x00", "").strip() or None
    return None


def _platform(system: str, arch: str, board: str | None, probe: Probe) -> str:
    if system == "darwin":
        return "apple-silicon" if arch == "arm64" else "macos"
    if system == "windows":
        return "windows"
    if probe.read("/etc/nv_tegra_release") is not None or (board and "jetson" in board.lower()):
        return "jetson"
    if board and board.lower().startswith("raspberry pi"):
        return "raspberry-pi"
    return system


def _gpus(probe: Probe, platform_name: str, cpu_model: str, total_ram: int) -> list[Accelerator]:
    gpus: list[Accelerator] = []
    if platform_name == "jetson":
        gpus.append(Accelerator("NVIDIA Tegra GPU", "igpu", "NVIDIA", "", total_ram, "tegra"))
    elif platform_name == "apple-silicon":
        gpus.append(Accelerator(f"{cpu_model} GPU", "igpu", "Apple", "", total_ram, "soc"))
    smi = probe.nvidia_smi()
    for line in (smi or "").splitlines():
        name, _, mib = line.rpartition(",")
        if name.strip():
            memory = int(mib.strip()) * 2**20 if mib.strip().isdigit() else None
            gpus.append(Accelerator(name.strip(), "gpu", "NVIDIA", "", memory, "nvidia-smi"))
    if smi is None:
        for entry in probe.listdir("/proc/driver/nvidia/gpus"):
            info = probe.read(f"/proc/driver/nvidia/gpus/{entry}/information") or ""
            model = next(
                (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("Model")),
                "NVIDIA GPU",
            )
            gpus.append(Accelerator(model, "gpu", "NVIDIA", "", None, "nvidia driver"))
    for card in probe.listdir("/sys/class/drm"):
        if not card.startswith("card") or "-" in card:
            continue
        vendor = _PCI_VENDORS.get(
            (probe.read(f"/sys/class/drm/{card}/device/vendor") or "").strip()
        )
        if vendor in ("Intel", "AMD"):
            gpus.append(Accelerator(f"{vendor} GPU", "gpu", vendor, "", None, "drm"))
    return gpus


def _npus(
    probe: Probe, platform_name: str, cpu_model: str, openvino: list[str]
) -> list[Accelerator]:
    npus: list[Accelerator] = []
    for dev in probe.listdir("/sys/class/accel"):
        uevent = probe.read(f"/sys/class/accel/{dev}/device/uevent") or ""
        driver = next(
            (ln.split("=", 1)[1] for ln in uevent.splitlines() if ln.startswith("DRIVER=")), ""
        )
        name = _ACCEL_DRIVERS.get(driver)
        if name:
            npus.append(Accelerator(name, "npu", name.split()[0], "", None, f"/dev/accel/{dev}"))
    vendors = {n.vendor for n in npus}
    cpu = cpu_model.lower()
    if platform_name == "apple-silicon":
        npus.append(Accelerator("Apple Neural Engine", "npu", "Apple", "", None, "soc"))
    if ("snapdragon" in cpu or "qualcomm" in cpu) and "Qualcomm" not in vendors:
        npus.append(Accelerator("Qualcomm Hexagon NPU", "npu", "Qualcomm", "", None, "cpu model"))
    if any(d.startswith("NPU") for d in openvino) and "Intel" not in vendors:
        npus.append(Accelerator("Intel NPU", "npu", "Intel", "", None, "openvino"))
    if "ryzen ai" in cpu and "AMD" not in vendors:
        npus.append(Accelerator("AMD XDNA NPU", "npu", "AMD", "", None, "cpu model"))
    return npus


def _ggml_devices(llama_cpp: Any) -> list[Accelerator]:
    """llama.cpp's devices (ggml backend registry), read from the loaded libggml."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    try:
        ggml = _load_first(lib_dir, ("libggml.so", "libggml.dylib", "ggml.dll"))
        base = _load_first(lib_dir, ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"))
    except OSError as exc:
        logger.debug("cannot read llama.cpp's device list: %s", exc)
        return []
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description", "ggml_backend_reg_name"):
        getattr(base, fn).restype = ctypes.c_char_p
        getattr(base, fn).argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_memory.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    found = []
    for i in range(int(ggml.ggml_backend_dev_count())):
        dev = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = base.ggml_backend_dev_backend_reg(dev)
        kind = _GGML_DEVICE_KINDS.get(base.ggml_backend_dev_type(dev), "accel")
        name = (base.ggml_backend_dev_name(dev) or b"").decode()
        description = (base.ggml_backend_dev_description(dev) or b"").decode()
        if description and kind != "cpu":
            name = f"{name} ({description})"
        found.append(
            Accelerator(
                name=name,
                kind=kind,
                backend=(base.ggml_backend_reg_name(reg) or b"").decode() if reg else "",
                memory_bytes=int(total.value) or None,
                source="llama.cpp",
            )
        )
    return found


def _load_first(folder: Path, names: tuple[str, ...]) -> ctypes.CDLL:
    for name in names:
        if (folder / name).exists():
            return ctypes.CDLL(str(folder / name))
    raise OSError(f"none of {', '.join(names)} in {folder}")


def _command(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
