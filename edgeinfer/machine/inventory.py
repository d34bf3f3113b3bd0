"""What this machine has: CPU, memory, accelerators and the engines' view of them.

``devices()`` reads the machine once per process and caches the result. Every fact comes
through a ``Probe`` (``probes.py``) — files such as ``/proc/cpuinfo`` and
``/proc/device-tree/model``, ``sysctl`` on macOS, the registry on Windows, onnxruntime's
provider list, llama.cpp's device list — and ``build_inventory`` turns those facts into a
``DeviceInventory``. Tests feed the
same function the facts recorded on real boards (``RecordedProbe``), so the parsing that runs
on a Raspberry Pi or a Jetson is the parsing under test here.

Reading the inventory never imports torch and never opens a network connection; the engines
are imported only if they are installed.
"""

from __future__ import annotations

import functools
import logging
import platform
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .probes import PACKAGES, Accelerator, MachineProbe, Probe

__all__ = ["PACKAGES", "DeviceInventory", "build_inventory", "devices"]

logger = logging.getLogger(__name__)

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
    # Which of PACKAGES are installed (found, not imported); None: a record made before they
    # were recorded, so they are inferred from its engines (``installed_packages``).
    packages: tuple[str, ...] | None = None

    @property
    def installed_packages(self) -> frozenset[str]:
        """Which of ``PACKAGES`` the route can count on. A record without ``packages`` has
        them inferred from its engines: llama_cpp where llama.cpp answered, onnxruntime where
        onnxruntime did, and onnx with onnxruntime (the ``[onnx]`` extra installs both)."""
        if self.packages is not None:
            return frozenset(self.packages)
        found = {"llama_cpp"} if self.llama_cpp_version is not None else set()
        if self.onnxruntime_version is not None:
            found |= {"onnxruntime", "onnx"}
        return frozenset(found)

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
        if values.get("packages") is not None:
            values["packages"] = tuple(values["packages"])
        return cls(**values)


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
        packages=_packages(probe.packages()),
    )


def _packages(found: Iterable[object] | None) -> tuple[str, ...] | None:
    """The known package names among ``found``, in ``PACKAGES`` order; None stays None."""
    if found is None:
        return None
    if isinstance(found, (str, bytes)) or not isinstance(found, Iterable):
        raise TypeError(f"packages: expected a list of names, got {found!r:.60}")
    names = set(found)
    return tuple(p for p in PACKAGES if p in names)


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
