"""Device inventory, provider policy and fallback at load.

The recorded machines in tests/data/machines hold the raw facts each platform exposes
(/proc/cpuinfo, the device-tree model, /etc/nv_tegra_release, sysctl, provider lists,
llama.cpp's device list); the inventory is built from them by the code that reads a real
machine, and the policy's choice for each is pinned here.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import edgeinfer
from edgeinfer import cli
from edgeinfer.errors import BackendUnavailableError, InvalidRequestError
from edgeinfer.machine.inventory import DeviceInventory, build_inventory, devices
from edgeinfer.machine.policy import plan_providers
from edgeinfer.machine.probes import Accelerator, RecordedProbe

MACHINES = Path(__file__).parent / "data" / "machines"


def machine(name: str) -> DeviceInventory:
    record = json.loads((MACHINES / f"{name}.json").read_text(encoding="utf-8"))
    return build_inventory(RecordedProbe(record))


def providers(inv: DeviceInventory, fmt: str, pref: str = "auto", **kw: Any) -> list[str]:
    return [c.provider for c in plan_providers(inv, fmt, pref, **kw).candidates]


# -- inventories built from recorded facts ----------------------------------------------------

FACTS = {
    "raspberry-pi-5": ("raspberry-pi", "Raspberry Pi 5 Model B Rev 1.0", "Cortex-A76",
                       ("neon", "fp16", "dotprod"), "arm64", "linux"),
    "raspberry-pi-4-1gb": ("raspberry-pi", "Raspberry Pi 4 Model B Rev 1.5", "Cortex-A72",
                           ("neon",), "arm64", "linux"),
    "jetson-orin-nano": ("jetson", "NVIDIA Jetson Orin Nano Developer Kit (L4T R36.4.0)",
                         "Cortex-A78AE", ("neon", "fp16", "dotprod"), "arm64", "linux"),
    "apple-m2": ("apple-silicon", None, "Apple M2", ("neon", "fp16", "dotprod", "i8mm", "bf16"),
                 "arm64", "darwin"),
    "snapdragon-x-elite": ("windows", None,
                           "Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Oryon(TM) CPU",
                           ("neon", "dotprod"), "arm64", "windows"),
    "intel-core-ultra-openvino": ("windows", None, "Intel(R) Core(TM) Ultra 7 155H",
                                  ("avx", "avx2"), "x86_64", "windows"),
    "x86-server": ("linux", None, "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz",
                   ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                    "avx512-vnni"), "x86_64", "linux"),
    "x86-rtx4090": ("linux", None, "AMD Ryzen 9 7950X 16-Core Processor",
                    ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                     "avx512-vnni", "avx512-bf16"), "x86_64", "linux"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FACTS))
def test_recorded_machine_inventory(name: str) -> None:
    inv = machine(name)
    platform, board, cpu, features, arch, os_name = FACTS[name]
    assert (inv.platform, inv.board, inv.cpu_model) == (platform, board, cpu)
    assert inv.cpu_features == features
    assert (inv.arch, inv.os) == (arch, os_name)
    assert inv.total_ram > 0 and 0 < inv.available_ram <= inv.total_ram
    # the dict form round-trips (what `edgeinfer devices --json` prints)
    assert DeviceInventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv


def test_recorded_accelerators() -> None:
    assert [n.name for n in machine("apple-m2").npus] == ["Apple Neural Engine"]
    assert [n.name for n in machine("snapdragon-x-elite").npus] == ["Qualcomm Hexagon NPU"]
    assert [n.name for n in machine("intel-core-ultra-openvino").npus] == ["Intel NPU"]
    assert machine("raspberry-pi-5").npus == ()
    assert [g.name for g in machine("x86-rtx4090").gpus] == ["NVIDIA GeForce RTX 4090"]
    assert machine("x86-rtx4090").gpus[0].memory_bytes == 24564 * 2**20
    jetson = machine("jetson-orin-nano")
    assert jetson.has_nvidia_gpu and jetson.gpus[0].kind == "igpu"
    assert [d.backend for d in jetson.llama_gpus] == ["CUDA"]
    assert [d.backend for d in machine("apple-m2").llama_gpus] == ["Metal"]
    assert machine("x86-server").gpus == () and not machine("x86-server").has_nvidia_gpu


# -- the policy's choice for each machine, format and preference --------------------------------

CPU, LCPU = "CPUExecutionProvider", "llama.cpp:CPU"
ERR = "error"
# machine -> {(format, preference): providers in order, or ERR}
_PI = {
    ("gguf", "auto"): [LCPU], ("onnx", "auto"): [CPU],
    ("gguf", "cuda"): ERR, ("onnx", "cuda"): ERR, ("onnx", "npu"): ERR, ("gguf", "metal"): ERR,
}  # fmt: skip
CHOICES: dict[str, dict[tuple[str, str], Any]] = {
    "raspberry-pi-4-1gb": _PI,
    "raspberry-pi-4-1gb-desktop": _PI,
    "raspberry-pi-5": {
        ("gguf", "auto"): [LCPU], ("onnx", "auto"): [CPU],
        ("gguf", "cuda"): ERR, ("onnx", "cuda"): ERR, ("onnx", "npu"): ERR, ("gguf", "metal"): ERR,
    },
    "jetson-orin-nano": {
        ("gguf", "auto"): ["llama.cpp:CUDA", LCPU],
        ("onnx", "auto"): ["TensorrtExecutionProvider", "CUDAExecutionProvider", CPU],
        ("gguf", "cuda"): ["llama.cpp:CUDA"],
        ("onnx", "cuda"): ["TensorrtExecutionProvider", "CUDAExecutionProvider"],
        ("onnx", "CUDAExecutionProvider"): ["CUDAExecutionProvider"],
        ("gguf", "metal"): ERR, ("onnx", "npu"): ERR, ("gguf", "cpu"): [LCPU],
    },
    "apple-m2": {
        ("gguf", "auto"): ["llama.cpp:Metal", LCPU],
        ("onnx", "auto"): ["CoreMLExecutionProvider", CPU],
        ("gguf", "metal"): ["llama.cpp:Metal"],
        ("onnx", "metal"): ["CoreMLExecutionProvider"],
        ("onnx", "npu"): ["CoreMLExecutionProvider"],
        ("gguf", "npu"): ERR, ("gguf", "cuda"): ERR, ("onnx", "cuda"): ERR,
    },
    "snapdragon-x-elite": {
        ("gguf", "auto"): [LCPU], ("onnx", "auto"): ["QNNExecutionProvider", CPU],
        ("onnx", "npu"): ["QNNExecutionProvider"], ("gguf", "npu"): ERR,
        ("onnx", "directml"): ERR, ("onnx", "cuda"): ERR, ("onnx", "cpu"): [CPU],
    },
    "intel-core-ultra-openvino": {
        ("gguf", "auto"): [LCPU],
        ("onnx", "auto"): ["OpenVINOExecutionProvider", "OpenVINOExecutionProvider", CPU],
        ("onnx", "npu"): ["OpenVINOExecutionProvider"],
        ("onnx", "gpu"): ["OpenVINOExecutionProvider"],
        ("onnx", "cuda"): ERR, ("gguf", "npu"): ERR,
    },
    "x86-server": {
        ("gguf", "auto"): [LCPU], ("onnx", "auto"): [CPU],
        ("gguf", "cuda"): ERR, ("onnx", "cuda"): ERR, ("onnx", "npu"): ERR,
        ("onnx", "metal"): ERR, ("gguf", "gpu"): ERR,
    },
    "x86-rtx4090": {
        ("gguf", "auto"): ["llama.cpp:CUDA", LCPU],
        ("onnx", "auto"): ["CUDAExecutionProvider", CPU],  # TensorRT only when asked by name
        ("onnx", "TensorrtExecutionProvider"): ["TensorrtExecutionProvider"],
        ("onnx", "cuda"): ["CUDAExecutionProvider"],
        ("gguf", "cuda"): ["llama.cpp:CUDA"], ("gguf", "metal"): ERR,
        ("gguf", "CUDAExecutionProvider"): ERR,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "fmt", "pref"),
    [(name, fmt, pref) for name, table in CHOICES.items() for fmt, pref in table],
)
def test_policy_choice_is_pinned(name: str, fmt: str, pref: str) -> None:
    expected = CHOICES[name][(fmt, pref)]
    inv = machine(name)
    if expected == ERR:
        with pytest.raises(BackendUnavailableError):
            plan_providers(inv, fmt, pref)
        # with fallback allowed the CPU takes over, and the plan says why
        plan = plan_providers(inv, fmt, pref, allow_fallback=True)
        assert [c.device for c in plan.candidates] == ["cpu"]
        assert plan.candidates[0].reason.startswith("fallback:")
        assert plan.skipped and all(s.reason for s in plan.skipped)
    else:
        assert providers(inv, fmt, pref) == expected
        plan = plan_providers(inv, fmt, pref)
        assert all(c.reason for c in plan.candidates)


def test_every_auto_plan_ends_on_the_cpu() -> None:
    for path in sorted(MACHINES.glob("*.json")):
        inv = machine(path.stem)
        for fmt in ("gguf", "onnx"):
            assert plan_providers(inv, fmt).candidates[-1].device == "cpu", (path.stem, fmt)


def test_provider_options_fit_the_platform() -> None:
    qnn = plan_providers(machine("snapdragon-x-elite"), "onnx").candidates[0]
    assert qnn.options["backend_path"] == "QnnHtp.dll"
    ov = plan_providers(machine("intel-core-ultra-openvino"), "onnx").candidates
    assert [c.options["device_type"] for c in ov[:2]] == ["GPU", "NPU"]
    coreml = plan_providers(machine("apple-m2"), "onnx", "npu").candidates[0]
    assert coreml.options["MLComputeUnits"] == "CPUAndNeuralEngine"
    assert plan_providers(machine("apple-m2"), "onnx").candidates[0].options["MLComputeUnits"] == (
        "ALL"
    )
    trt = plan_providers(machine("jetson-orin-nano"), "onnx").candidates[0]
    assert trt.options["trt_engine_cache_enable"] is True
    gpu = plan_providers(machine("jetson-orin-nano"), "gguf").candidates[0]
    assert gpu.options["n_gpu_layers"] == -1


@pytest.mark.parametrize(
    ("name", "fmt", "pref", "hint"),
    [
        ("x86-server", "onnx", "cuda", "onnxruntime-gpu"),
        ("x86-server", "gguf", "cuda", "GGML_CUDA=on"),
        ("raspberry-pi-5", "gguf", "metal", "Apple Silicon"),
        ("snapdragon-x-elite", "gguf", "npu", "convert the model to ONNX"),
        ("raspberry-pi-5", "onnx", "npu", "no NPU was found"),
        ("intel-core-ultra-openvino", "onnx", "cuda", "onnxruntime-gpu"),
        ("x86-rtx4090", "gguf", "CUDAExecutionProvider", "GGUF models run on llama.cpp"),
        ("snapdragon-x-elite", "onnx", "directml", "onnxruntime-directml"),
    ],
)
def test_unmet_preference_names_what_to_install(name: str, fmt: str, pref: str, hint: str) -> None:
    with pytest.raises(BackendUnavailableError, match="allow_fallback") as info:
        plan_providers(machine(name), fmt, pref)
    assert hint in str(info.value)


def test_jetson_with_a_cpu_only_llama_build_says_how_to_get_the_gpu() -> None:
    inv = dataclasses.replace(
        machine("jetson-orin-nano"),
        llama_gpu_offload=False,
        llama_devices=(Accelerator("CPU", "cpu", backend="CPU"),),
    )
    plan = plan_providers(inv, "gguf")
    assert [c.provider for c in plan.candidates] == [LCPU]
    assert "GGML_CUDA=on" in plan.skipped[0].reason


def test_bad_preferences_are_rejected() -> None:
    inv = machine("x86-server")
    for bad in ("tpu", "", "  "):
        with pytest.raises(InvalidRequestError):
            plan_providers(inv, "onnx", bad)
    with pytest.raises(InvalidRequestError):
        edgeinfer.load("smollm2-135m-instruct", allow_fallback="yes")  # type: ignore[arg-type]


def test_missing_engine_is_named() -> None:
    inv = dataclasses.replace(machine("x86-server"), onnxruntime_version=None, ort_providers=())
    with pytest.raises(BackendUnavailableError, match=r"edgeinfer\[onnx\]"):
        plan_providers(inv, "onnx")


# -- this machine -----------------------------------------------------------------------------


def test_this_machine_inventory() -> None:
    inv = devices()
    assert inv is devices()  # read once per process
    assert inv.logical_cores >= 1 and inv.total_ram > 0
    assert "CPUExecutionProvider" in inv.ort_providers
    assert inv.llama_cpp_version is not None
    assert any(d.kind == "cpu" for d in inv.llama_devices)


def test_inventory_imports_no_torch_and_opens_no_socket() -> None:
    code = (
        "import socket, sys\n"
        "def refuse(*a, **k): raise AssertionError('network touched')\n"
        "socket.socket = refuse; socket.create_connection = refuse\n"
        "import edgeinfer\n"
        "inv = edgeinfer.devices()\n"
        "assert inv.ort_providers and inv.llama_cpp_version, inv\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_cli_devices_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["devices", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    inv = out["inventory"]
    assert inv["cpu_model"] and inv["cpu_features"] and inv["total_ram"] > 0
    assert "CPUExecutionProvider" in inv["ort_providers"]
    assert inv["llama_gpu_offload"] is False
    assert "plan" not in out


@pytest.mark.model
def test_cli_devices_with_the_default_model(
    default_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["devices", "smollm2-135m-instruct"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp" in out and "GPU offload no" in out
    # on the CPU a catalog GGUF runs through its exact ONNX transcode (machine/routes.py)
    assert "plan for smollm2-135m-instruct (gguf, run as onnx), device=auto:" in out
    assert "1. CPUExecutionProvider" in out
    assert cli.main(["devices", "smollm2-135m-instruct", "--json", "--device", "cuda",
                     "--allow-fallback"]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert [c["provider"] for c in plan["candidates"]] == [LCPU]
    assert plan["skipped"][0]["provider"] == "llama.cpp:CUDA"


def test_cli_devices_for_a_recorded_machine(
    default_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["devices", str(default_gguf), "--inventory", str(MACHINES / "apple-m2.json")]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "apple-silicon" in out and "1. llama.cpp:Metal" in out
    assert cli.main(["devices", "--inventory", str(default_gguf)]) == 1  # not a record
    assert "not a recorded machine" in capsys.readouterr().err


# -- fallback at load -------------------------------------------------------------------------


def _with_cuda(inv: DeviceInventory) -> DeviceInventory:
    """This machine, as if onnxruntime-gpu and a CUDA llama.cpp build were installed."""
    return dataclasses.replace(
        inv,
        ort_providers=("CUDAExecutionProvider", *inv.ort_providers),
        gpus=(Accelerator("NVIDIA Test GPU", "gpu", "NVIDIA", memory_bytes=8 * 2**30),),
        llama_gpu_offload=True,
        llama_devices=(Accelerator("CUDA0 (NVIDIA Test GPU)", "gpu", backend="CUDA"),
                       *inv.llama_devices),
    )  # fmt: skip


@pytest.mark.model
def test_onnx_provider_failing_at_session_creation_falls_back_to_cpu(
    default_onnx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime

    folder = default_onnx("fp32")
    real = onnxruntime.InferenceSession
    seen: list[Any] = []

    def session(path: str, options: Any = None, providers: Any = None, **kw: Any) -> Any:
        seen.append(providers)
        first = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
        if first == "CUDAExecutionProvider":
            raise RuntimeError("CUDA failure 100: no CUDA-capable device is detected")
        return real(path, options, providers=providers, **kw)

    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    for where in ("edgeinfer.loader.devices", "edgeinfer.load_plan.devices"):
        monkeypatch.setattr(where, lambda **kw: _with_cuda(devices()))
    with edgeinfer.load(folder, context_length=64) as model:
        info = model.info
        assert info["provider"] == CPU and info["device"] == "cpu"
        chain = info["fallback_chain"]
        assert [(c["provider"], c["outcome"]) for c in chain] == [
            ("CUDAExecutionProvider", "failed"),
            (CPU, "chosen"),
        ]
        assert "no CUDA-capable device" in chain[0]["error"]
        assert model.generate("The capital of France is", max_new_tokens=3, temperature=0).text
    assert seen[0] == [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]


@pytest.mark.model
def test_onnx_provider_silently_dropped_by_onnxruntime_is_a_failure(
    default_onnx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnxruntime runs on the CPU with only a warning when a provider's libraries fail to
    load; load() must notice and say so, not report CUDA."""
    import onnxruntime

    real = onnxruntime.InferenceSession

    def session(path: str, options: Any = None, providers: Any = None, **kw: Any) -> Any:
        return real(path, options, providers=["CPUExecutionProvider"], **kw)

    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    for where in ("edgeinfer.loader.devices", "edgeinfer.load_plan.devices"):
        monkeypatch.setattr(where, lambda **kw: _with_cuda(devices()))
    with pytest.raises(BackendUnavailableError, match="did not enable CUDAExecutionProvider"):
        edgeinfer.load(default_onnx("fp32"), device="cuda", context_length=64)
    with edgeinfer.load(
        default_onnx("fp32"), device="cuda", allow_fallback=True, context_length=64
    ) as model:
        chain = model.info["fallback_chain"]
        assert [c["outcome"] for c in chain] == ["failed", "chosen"]
        assert "did not enable CUDAExecutionProvider" in chain[0]["error"]


@pytest.mark.model
def test_gguf_offload_failure_falls_back_to_cpu(
    default_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import llama_cpp

    real = llama_cpp.llama_model_load_from_file
    layers: list[int] = []

    def load_from_file(path: bytes, params: Any) -> Any:
        layers.append(int(params.n_gpu_layers))
        return None if params.n_gpu_layers != 0 else real(path, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", load_from_file)
    for where in ("edgeinfer.loader.devices", "edgeinfer.load_plan.devices"):
        monkeypatch.setattr(where, lambda **kw: _with_cuda(devices()))
    with caplog.at_level("INFO", logger="edgeinfer"):
        model = edgeinfer.load(default_gguf, context_length=64)
    with model:
        assert layers == [-1, 0]
        chain = model.info["fallback_chain"]
        assert [(c["provider"], c["outcome"]) for c in chain] == [
            ("llama.cpp:CUDA", "failed"),
            (LCPU, "chosen"),
        ]
        assert "with its layers on the GPU" in chain[0]["error"]
        assert model.info["n_gpu_layers"] == 0
    said = [r.getMessage() for r in caplog.records if "runs on" in r.getMessage()]
    assert len(said) == 1 and "llama.cpp:CUDA failed" in said[0]


@pytest.mark.model
def test_cuda_on_this_machine(default_gguf: Path, default_onnx: Any) -> None:
    with pytest.raises(BackendUnavailableError, match="GGML_CUDA=on"):
        edgeinfer.load(default_gguf, device="cuda")
    with pytest.raises(BackendUnavailableError, match="onnxruntime-gpu"):
        edgeinfer.load(default_onnx("fp32"), device="cuda")
    for path in (default_gguf, default_onnx("fp32")):
        with edgeinfer.load(path, device="cuda", allow_fallback=True, context_length=64) as m:
            assert m.info["device"] == "cpu"
            chain = m.info["fallback_chain"]
            assert chain[0]["outcome"] == "chosen" and chain[0]["reason"].startswith("fallback")
            assert chain[1]["outcome"] == "unavailable"


def test_corrupt_model_error_is_not_masked_by_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.ggufgen import write_gguf

    bad = write_gguf(tmp_path / "bad.gguf", tensors=1)
    for where in ("edgeinfer.loader.devices", "edgeinfer.load_plan.devices"):
        monkeypatch.setattr(where, lambda **kw: _with_cuda(devices()))
    with pytest.raises(edgeinfer.ModelLoadError) as info:
        edgeinfer.load(bad)
    assert "also tried llama.cpp:CUDA" in str(info.value)


def test_provider_names_in_any_case() -> None:
    inv = machine("x86-rtx4090")
    assert providers(inv, "onnx", "CPUExecutionProvider") == [CPU]
    assert providers(inv, "onnx", "cudaexecutionprovider") == ["CUDAExecutionProvider"]
    assert providers(inv, "gguf", "CPUExecutionProvider") == [LCPU]


def test_recording_this_machine_replays_to_the_same_inventory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgeinfer.machine.probes import MachineProbe, RecordingProbe

    recorder = RecordingProbe(MachineProbe())
    live = build_inventory(recorder)
    replayed = build_inventory(RecordedProbe(json.loads(json.dumps(recorder.record))))
    assert replayed == live
    assert "/proc/cpuinfo" in recorder.record["files"]
    out = tmp_path / "this-machine.json"
    assert cli.main(["devices", "--record", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    inv = build_inventory(RecordedProbe(json.loads(out.read_text())))
    assert inv.cpu_model == live.cpu_model and inv.ort_providers == live.ort_providers


def test_amx_cpus_keep_llama_cpp_weights_out_of_amx_buffers() -> None:
    """Recorded on the CI machine kind (a Xeon with AMX), where llama.cpp's AMX weight
    buffers crashed llama_decode with SIGSEGV; other CPUs keep llama.cpp's default."""
    amx = plan_providers(machine("x86-xeon-amx"), "gguf", "cpu").candidates[0]
    assert amx.options["use_extra_bufts"] is False and "AMX" in amx.reason
    for name in ("x86-server", "raspberry-pi-5", "apple-m2"):
        other = plan_providers(machine(name), "gguf", "cpu").candidates[0]
        assert "use_extra_bufts" not in other.options


@pytest.mark.parametrize(
    ("name", "row", "inferred"),
    [
        ("snapdragon-x-elite", "npus", True),  # named from the CPU model string
        ("jetson-orin-nano", "gpus", True),  # its memory is the board's RAM
        ("apple-m2", "gpus", True),
        ("x86-rtx4090", "gpus", False),  # nvidia-smi answered
    ],
)
def test_devices_says_which_accelerators_are_inferred(name: str, row: str, inferred: bool) -> None:
    from edgeinfer.cli.devices import _rows

    rows = dict(_rows(machine(name)))
    assert ("inferred from" in rows[row]) is inferred, rows[row]
    assert ("not probed" in rows[row]) is inferred
