"""The route and provider a catalog GGUF gets on each recorded machine, from that machine's
own packages and devices (``routes.route_on``); ``edgeinfer devices MODEL --inventory FILE``
prints the same; old records (no ``packages``) load and say what was assumed; hostile records
are refused with one error line.

The docs' rule (docs/index.md, docs/performance.md): a GPU that llama.cpp drives keeps the
GGUF on llama.cpp; on a CPU a catalog GGUF runs its exact ONNX transcode when onnxruntime and
onnx are installed.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer import cli
from edgeinfer.cli.devices import _recorded
from edgeinfer.errors import BackendUnavailableError, InvalidRequestError
from edgeinfer.loader import resolve, route_for
from edgeinfer.machine.inventory import DeviceInventory, build_inventory, devices
from edgeinfer.machine.policy import plan_providers
from edgeinfer.machine.probes import PACKAGES, MachineProbe, RecordedProbe, RecordingProbe
from edgeinfer.machine.routes import route_on

from .signals import sigint_default

MACHINES = Path(__file__).parent / "data" / "machines"
DEFAULT = "smollm2-135m-instruct"
CPU, LCPU = "CPUExecutionProvider", "llama.cpp:CPU"


def record(name: str) -> dict[str, Any]:
    return json.loads((MACHINES / f"{name}.json").read_text(encoding="utf-8"))


def machine(name: str, **changes: Any) -> DeviceInventory:
    facts = record(name)
    for key, value in changes.items():
        if value is None:
            facts.pop(key, None)
        else:
            facts[key] = value
    return build_inventory(RecordedProbe(facts))


def chosen(inv: DeviceInventory, device: str = "auto", parallel: int = 1) -> tuple[str, str]:
    """(the route's format, the first provider load() tries) for the catalog GGUF."""
    route = route_on(inv, "gguf", transcodable=True, device=device, parallel=parallel)
    return route.format, plan_providers(inv, route.format, device).candidates[0].provider


# machine -> (route, first provider) for the default model at device="auto", one sequence
ROUTES = {
    "apple-m2": ("gguf", "llama.cpp:Metal"),
    "intel-core-ultra-openvino": ("onnx", "OpenVINOExecutionProvider"),
    "jetson-orin-nano": ("gguf", "llama.cpp:CUDA"),
    "raspberry-pi-4-1gb": ("onnx", CPU),
    "raspberry-pi-4-1gb-desktop": ("onnx", CPU),
    "raspberry-pi-5": ("onnx", CPU),
    "snapdragon-x-elite": ("onnx", "QNNExecutionProvider"),
    "x86-rtx4090": ("gguf", "llama.cpp:CUDA"),
    "x86-server": ("onnx", CPU),
    "x86-xeon-amx": ("onnx", CPU),
}


def test_every_recorded_machine_has_its_route_pinned() -> None:
    assert sorted(ROUTES) == sorted(p.stem for p in MACHINES.glob("*.json"))


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_the_route_and_provider_on_each_recorded_machine(name: str) -> None:
    inv = machine(name)
    assert chosen(inv) == ROUTES[name]
    assert chosen(inv, parallel=4)[0] == ROUTES[name][0]
    assert chosen(inv, "cpu") == ("onnx", CPU)  # the CPU route: the transcode
    # old records: the packages are inferred from the engines that answered
    assert inv.packages is None and inv.installed_packages == frozenset(PACKAGES)


@pytest.mark.parametrize("name", sorted(ROUTES))
@pytest.mark.parametrize("device", ["auto", "gpu", "cuda", "metal"])
@pytest.mark.parametrize("parallel", [1, 2, 8])
def test_a_gpu_that_llama_cpp_drives_keeps_the_gguf(name: str, device: str, parallel: int) -> None:
    inv = machine(name)
    try:
        llama = plan_providers(inv, "gguf", device).candidates[0].device
    except BackendUnavailableError:  # llama.cpp cannot meet the wish here
        llama = "cpu"
    route = route_on(inv, "gguf", transcodable=True, device=device, parallel=parallel)
    if llama != "cpu":
        assert route.format == "gguf", (name, device, parallel, route.why)
        assert "GPU" in route.why


def test_recorded_packages_are_what_the_route_reads() -> None:
    # an RTX 4090 whose llama-cpp-python is not installed: the transcode, on CUDA
    no_llama = machine("x86-rtx4090", llama_cpp=None, packages=["onnxruntime", "onnx"])
    assert no_llama.installed_packages == {"onnxruntime", "onnx"}
    assert chosen(no_llama) == ("onnx", "CUDAExecutionProvider")
    # a Raspberry Pi 5 without onnx (the transcode's builder): llama.cpp runs the file
    no_builder = machine("raspberry-pi-5", packages=["llama_cpp", "onnxruntime"])
    route = route_on(no_builder, "gguf", transcodable=True, device="auto")
    assert (route.format, "onnx is not installed" in route.why) == ("gguf", True)
    assert chosen(no_builder) == ("gguf", LCPU)
    # an M2 with llama.cpp only: Metal
    assert chosen(machine("apple-m2", onnxruntime=None, packages=["llama_cpp"])) == (
        "gguf",
        "llama.cpp:Metal",
    )
    # a GGUF named by its path stays on llama.cpp everywhere
    for name in ROUTES:
        assert route_on(machine(name), "gguf", transcodable=False).format == "gguf"


def test_an_old_record_says_what_it_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(MACHINES / "x86-rtx4090.json")
    assert cli.main(["devices", "--inventory", path]) == 0
    out = capsys.readouterr().out
    assumed = "not recorded (an older record); assumed llama_cpp, onnxruntime, onnx"
    assert f"packages     {assumed}" in out
    assert cli.main(["devices", "--inventory", path, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["inventory"]["packages"] is None
    assert shown["packages_assumed"].startswith("not recorded")


def test_a_new_record_names_its_packages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    facts = record("raspberry-pi-5") | {"packages": ["llama_cpp"]}
    path = tmp_path / "pi5.json"
    path.write_text(json.dumps(facts))
    assert cli.main(["devices", "--inventory", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["inventory"]["packages"] == ["llama_cpp"] and "packages_assumed" not in shown
    inv = _recorded(path)
    assert DeviceInventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv


def test_recording_this_machine_keeps_its_packages() -> None:
    recorder = RecordingProbe(MachineProbe())
    live = build_inventory(recorder)
    assert recorder.record["packages"] == list(live.packages or ())
    assert set(live.packages or ()) == {"llama_cpp", "onnxruntime", "onnx"}  # the test venv
    assert build_inventory(RecordedProbe(json.loads(json.dumps(recorder.record)))) == live


def test_this_machine_gets_the_route_load_takes(tiny_llama_gguf: Path, default_gguf: Path) -> None:
    """route_on over this machine's inventory is the route load() takes here."""
    inv = devices()
    for model in (DEFAULT, str(tiny_llama_gguf)):
        source = resolve(model)
        transcodable = model == DEFAULT
        for device in ("auto", "cpu"):
            for parallel in (1, 4):
                mine = route_on(inv, "gguf", transcodable=transcodable, device=device,
                                parallel=parallel)  # fmt: skip
                assert mine == route_for(model, source, device, parallel=parallel)


@pytest.mark.parametrize(
    ("name", "shown", "first"),
    [
        ("x86-rtx4090", "(gguf)", "1. llama.cpp:CUDA"),
        ("apple-m2", "(gguf)", "1. llama.cpp:Metal"),
        ("jetson-orin-nano", "(gguf)", "1. llama.cpp:CUDA"),
        ("raspberry-pi-5", "(gguf, run as onnx)", "1. CPUExecutionProvider"),
        ("snapdragon-x-elite", "(gguf, run as onnx)", "1. QNNExecutionProvider"),
    ],
)
def test_devices_plans_a_recorded_machine_with_its_packages(
    name: str, shown: str, first: str, default_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["devices", DEFAULT, "--inventory", str(MACHINES / f"{name}.json")]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"plan for {DEFAULT} {shown}, device=auto:" in out
    assert f"  {first}:" in out and "  route: " in out
    assert cli.main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["route"]["format"] == ROUTES[name][0]
    assert plan["plan"]["candidates"][0]["provider"] == ROUTES[name][1]


# -- hostile records ----------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
_KEYS = ["system", "machine", "release", "files", "sysctl", "memory", "cores", "nvidia_smi",
         "onnxruntime", "llama_cpp", "openvino_devices", "packages", "windows_cpu"]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(ROUTES)), st.dictionaries(st.sampled_from(_KEYS), _json, max_size=3))
def test_a_recorded_machine_with_any_facts_replaced_is_read_or_refused(
    name: str, replaced: dict[str, Any]
) -> None:
    facts = copy.deepcopy(record(name)) | replaced
    try:
        inv = build_inventory(RecordedProbe(facts))
    except ValueError as exc:  # RecordError: the field is named
        assert str(exc)
        return
    for fmt in ("gguf", "onnx"):
        try:
            chosen(inv) if fmt == "gguf" else plan_providers(inv, fmt)
        except BackendUnavailableError as exc:  # a missing engine is named
            assert "pip install" in str(exc)
    assert DeviceInventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv


@settings(max_examples=200, deadline=None)
@given(_json)
def test_any_json_is_a_record_or_one_error(value: Any) -> None:
    try:
        build_inventory(RecordedProbe(value))
    except ValueError as exc:
        assert str(exc)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_as_an_inventory_file_are_refused_in_one_line(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "machine.json"
        path.write_bytes(data)
        try:
            _recorded(path)
        except InvalidRequestError as exc:
            assert str(exc).startswith(f"--inventory {path}: not a recorded machine (")


_HOSTILE = {
    "files-a-list.json": b'{"system": "Linux", "machine": "x86_64", "files": [],'
    b' "memory": {"total": 1}, "cores": {"physical": 1, "logical": 1}}',
    "huge-number.json": b'{"system": "Linux", "machine": "x", "memory": {"total": 1e400},'
    b' "cores": {"physical": 1, "logical": 1}}',
    "deep.json": b"[" * 100_000 + b"]" * 100_000,
    "not-utf8.json": b"\xff\xfe{}",
    "zero-cores.json": b'{"system": "Linux", "machine": "x", "memory": {"total": 1},'
    b' "cores": {"physical": 0, "logical": 0}}',
    "bad-device.json": b'{"system": "Linux", "machine": "x", "memory": {"total": 1},'
    b' "cores": {"physical": 1, "logical": 1}, "llama_cpp": {"version": "1",'
    b' "gpu_offload": true, "devices": [{"name": 3, "kind": "gpu"}]}}',
    "packages-text.json": b'{"system": "Linux", "machine": "x", "memory": {"total": 1},'
    b' "cores": {"physical": 1, "logical": 1}, "packages": "llama_cpp"}',
}


@pytest.mark.parametrize("name", sorted(_HOSTILE))
def test_the_devices_cli_refuses_a_hostile_record_in_one_line(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_bytes(_HOSTILE[name])
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "devices", DEFAULT, "--inventory", str(path)],
        capture_output=True, text=True, timeout=300, preexec_fn=sigint_default,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: --inventory "), lines
    assert "not a recorded machine" in lines[0] and done.stdout == ""


@pytest.mark.parametrize("name", ["x86-rtx4090", "apple-m2", "jetson-orin-nano"])
def test_load_keeps_the_gguf_on_a_gpu_llama_cpp_drives(
    name: str, default_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import edgeinfer.load_plan as load_plan

    inv = machine(name)
    monkeypatch.setattr(load_plan, "devices", lambda engines=(): inv)
    source = resolve(DEFAULT)
    assert route_for(DEFAULT, source, "auto").format == "gguf"
    assert route_for(DEFAULT, source, "auto") == route_on(inv, "gguf", transcodable=True)
