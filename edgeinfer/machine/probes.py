"""Where facts about a machine come from, and the accelerators they report.

A ``Probe`` hands out raw facts: files such as ``/proc/cpuinfo`` and
``/proc/device-tree/model``, ``sysctl`` on macOS, the registry on Windows, onnxruntime's
provider list, llama.cpp's device list (read from the loaded libggml). ``MachineProbe`` reads
them from this machine; ``RecordingProbe`` wraps a probe and writes down every fact it hands
out (``edgeinfer devices --record FILE``); ``RecordedProbe`` replays such a record, so the
tests and ``--inventory`` run ``inventory.build_inventory`` on facts recorded on real boards.

Reading facts never imports torch and never opens a network connection; the engines are
imported only if they are installed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

__all__ = [
    "PACKAGES",
    "Accelerator",
    "MachineProbe",
    "Probe",
    "RecordError",
    "RecordedProbe",
    "RecordingProbe",
    "check_record",
]

logger = logging.getLogger(__name__)

# llama.cpp's ggml_backend_dev_type enum.
_GGML_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}
# Windows IsProcessorFeaturePresent constants (winnt.h).
_WINDOWS_FEATURES = {
    19: "neon",  # PF_ARM_NEON_INSTRUCTIONS_AVAILABLE
    39: "avx",  # PF_AVX_INSTRUCTIONS_AVAILABLE
    40: "avx2",  # PF_AVX2_INSTRUCTIONS_AVAILABLE
    41: "avx512f",  # PF_AVX512F_INSTRUCTIONS_AVAILABLE
    43: "dotprod",  # PF_ARM_V82_DP_INSTRUCTIONS_AVAILABLE
}


@dataclass(frozen=True)
class Accelerator:
    """A GPU or NPU, as one source reported it."""

    name: str
    kind: str  # "gpu" | "igpu" | "npu" | "accel"
    vendor: str = ""
    backend: str = ""  # the engine backend that drives it: "CUDA", "Metal", "Vulkan", ...
    memory_bytes: int | None = None  # total; shared with the host for integrated devices
    source: str = ""


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
    def packages(self) -> list[str] | None: ...  # the route's packages found; None: unknown


# The Python packages a route depends on, the two engines and the transcode's builder: found
# (importlib.util.find_spec), never imported.
PACKAGES = ("llama_cpp", "onnxruntime", "onnx")


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

    def packages(self) -> list[str]:
        return [name for name in PACKAGES if importlib.util.find_spec(name) is not None]


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

    def packages(self) -> list[str] | None:
        value = self._inner.packages()
        if value is not None:
            self.record["packages"] = list(value)
        return value


class RecordedProbe:
    """Facts recorded on another machine (a JSON object), for tests and ``--inventory``; a
    record of another shape raises ``RecordError`` naming the field (``check_record``)."""

    def __init__(self, record: Mapping[str, Any]) -> None:
        self._r = check_record(record)

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

    def packages(self) -> list[str] | None:
        """None for a record made before packages were recorded."""
        value = self._r.get("packages")
        return None if value is None else list(value)


class RecordError(ValueError):
    """A recorded machine whose facts do not have the shape ``RecordingProbe`` writes."""


def _text(v: object) -> bool:
    return isinstance(v, str)


def _texts(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _text_map(v: object) -> bool:
    return isinstance(v, dict) and all(x is None or isinstance(x, str) for x in v.values())


def _size(v: object) -> bool:  # bytes, cores: a plain non-negative integer
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _count(v: object) -> bool:
    return _size(v) and v != 0


def _flag(v: object) -> bool:
    return isinstance(v, bool)


def _fields(need: dict[str, Any], may: dict[str, Any] | None = None) -> Any:
    """A check of an object with the ``need`` keys and perhaps the ``may`` keys, no others."""
    known = {**need, **(may or {})}

    def check(v: object) -> bool:
        return (
            isinstance(v, dict)
            and set(need) <= set(v) <= set(known)
            and all(known[k](v[k]) for k in v)
        )

    return check


def _devices(v: object) -> bool:
    device = _fields({"name": _text, "kind": _text}, {"vendor": _text, "backend": _text,
                     "memory_bytes": lambda m: m is None or _size(m)})  # fmt: skip
    return isinstance(v, list) and all(device(d) for d in v)


# What each recorded fact must look like, and how a message says it.
_RECORD: dict[str, tuple[Any, str]] = {
    "system": (_text, "a text such as 'Linux'"),
    "machine": (_text, "a text such as 'x86_64'"),
    "release": (_text, "a text"),
    "description": (_text, "a text"),
    "nvidia_smi": (_text, "nvidia-smi's 'name, MiB' lines as one text"),
    "files": (_text_map, "an object of path -> text (or null)"),
    "sysctl": (_text_map, "an object of name -> text (or null)"),
    "memory": (_fields({"total": _size}, {"available": _size}),
               '{"total": bytes, "available": bytes}'),
    "cores": (_fields({"physical": _count, "logical": _count}),
              '{"physical": N, "logical": N}, each at least 1'),
    "windows_cpu": (_fields({}, {"name": _text, "features": _texts}),
                    '{"name": text, "features": [names]}'),
    "onnxruntime": (_fields({"version": _text, "providers": _texts}),
                    '{"version": text, "providers": [names]}'),
    "llama_cpp": (_fields({"version": _text, "gpu_offload": _flag}, {"devices": _devices}),
                  '{"version": text, "gpu_offload": true/false, "devices": [{"name", "kind", '
                  '"vendor", "backend", "memory_bytes"}]}'),
    "openvino_devices": (_texts, "a list of device names"),
    "packages": (_texts, "a list of package names"),
}  # fmt: skip
_REQUIRED = ("system", "machine", "memory", "cores")


def check_record(record: object) -> Mapping[str, Any]:
    """A copy of ``record`` if it has the shape of a recorded machine; ``RecordError`` naming
    the first field that does not. Facts it does not know are ignored; a fact of null counts
    as not recorded (left out of the copy)."""
    if not isinstance(record, Mapping):
        raise RecordError(f"expected a JSON object of facts, got {type(record).__name__}")
    missing = [key for key in _REQUIRED if record.get(key) is None]
    if missing:
        raise RecordError(f"{', '.join(missing)} missing")
    for key, (check, shape) in _RECORD.items():
        if record.get(key) is not None and not check(record[key]):
            raise RecordError(f"{key}: expected {shape}")
    return {key: value for key, value in record.items() if value is not None}


def _ggml_devices(llama_cpp: Any) -> list[Accelerator]:
    """llama.cpp's devices (ggml backend registry), read from the loaded libggml."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    try:
        ggml = _load_first(lib_dir, ("libggml.so", "libggml.dylib", "ggml.dll"))
        base = _load_first(lib_dir, ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"))
    except OSError as exc:
        logger.debug("cannot read llama.cpp's device list: %s", exc)
        return []
    _declare(ggml, base)
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


def _declare(ggml: ctypes.CDLL, base: ctypes.CDLL) -> None:
    """The C signatures of the ggml backend-registry calls ``_ggml_devices`` makes."""
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
