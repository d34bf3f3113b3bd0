"""``edgeinfer devices [MODEL]``: what this machine has and, for a model, which provider runs it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..bounded_json import read_json_file
from ..config import LoadConfig
from ..errors import EdgeInferError, InvalidRequestError
from ..load_plan import Machine, plan_load, route_for
from ..machine.busy import busy_record
from ..machine.inventory import DeviceInventory, build_inventory, devices
from ..machine.policy import ProviderPlan, plan_providers
from ..machine.probes import PACKAGES, MachineProbe, RecordedProbe, RecordingProbe
from ..machine.routes import Route
from ..memory.plan import MemoryBudget, MemoryPlan
from .common import MODEL_HELP


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "devices",
        help="show this machine's CPU, memory and accelerators, and the plan for a model",
        description="Print what edgeinfer sees on this machine: CPU and its features, memory, "
        "GPUs and NPUs, onnxruntime's providers and llama.cpp's GPU offload. Given MODEL, also "
        "print the providers load() would try for it, in order, with the reason for each.",
    )
    p.add_argument("model", metavar="MODEL", nargs="?", help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument(
        "--device", default="auto", help="the device preference to plan for (default: auto)"
    )
    p.add_argument(
        "--allow-fallback",
        action="store_true",
        help="plan a CPU fallback when the device preference cannot be met",
    )
    p.add_argument(
        "--memory-budget", metavar="SIZE", help="plan memory for this budget (e.g. 512MB)"
    )
    p.add_argument("--context-length", type=int, metavar="N", help="plan for this context")
    p.add_argument(
        "--record",
        metavar="FILE",
        type=Path,
        help="write this machine's raw facts (the --inventory format) to FILE, for tests",
    )
    p.add_argument(
        "--inventory",
        metavar="FILE",
        type=Path,
        help="plan for a recorded machine (JSON facts, as in tests/data/machines) instead",
    )


@dataclass(frozen=True)
class _ModelPlan:
    """What `devices MODEL` shows beside the machine: the providers and the memory plan."""

    source_text: str  # "name (format)"
    route: Route
    providers: ProviderPlan
    memory: MemoryPlan | None
    memory_error: str | None  # why there is no memory plan: the budget, or a failed load


def cmd_devices(args: argparse.Namespace) -> int:
    if args.record:
        return _record(args.record)
    inventory = _recorded(args.inventory) if args.inventory else devices()
    plan = _plan_for(args, inventory) if args.model else None
    if args.json:
        _print_json(args, inventory, plan)
    else:
        _print_text(args, inventory, plan)
    return 0


def _record(path: Path) -> int:
    recorder = RecordingProbe(MachineProbe())
    build_inventory(recorder)
    path.write_text(json.dumps(recorder.record, indent=1, ensure_ascii=False) + "\n")
    print(path)
    return 0


def _plan_for(args: argparse.Namespace, inventory: DeviceInventory) -> _ModelPlan:
    from ..loader import resolve

    source = resolve(args.model)
    # a recorded machine: its packages and devices, as its record says; else this one
    machine = Machine(inventory) if args.inventory else Machine()
    route = route_for(args.model, source, args.device, machine=machine)
    memory, memory_error, planned = _memory(source, machine, args)
    route = planned or route  # the plan may keep a GGUF on llama.cpp (a budget too small)
    # a GGUF that runs as onnx: load() runs it through its ONNX graph, built once
    shown = source.format if route.format == source.format else "gguf, run as onnx"
    providers = plan_providers(
        inventory, route.format, args.device, allow_fallback=args.allow_fallback
    )
    return _ModelPlan(f"{source.name} ({shown})", route, providers, memory, memory_error)


def _print_json(
    args: argparse.Namespace, inventory: DeviceInventory, plan: _ModelPlan | None
) -> None:
    out: dict[str, Any] = {"inventory": inventory.to_dict()}
    if inventory.packages is None:
        out["packages_assumed"] = _assumed(inventory)
    if not args.inventory:  # a live machine: how busy it is now
        out["busy"] = busy_record()
    if plan is not None:
        out["model"] = args.model
        out["route"] = plan.route.to_dict()
        out["plan"] = plan.providers.to_dict()
        out["memory_plan"] = plan.memory.to_dict() if plan.memory else None
        if plan.memory_error:
            out["memory_error"] = plan.memory_error
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _print_text(
    args: argparse.Namespace, inventory: DeviceInventory, plan: _ModelPlan | None
) -> None:
    for label, value in _rows(inventory):
        print(f"{label:<12} {value}")
    if not args.inventory:  # a live machine: how busy it is now
        print(f"{'cpu load':<12} {busy_record()['line']}")
    if plan is None:
        return
    print(f"\nplan for {plan.source_text}, device={args.device}:")
    print(f"  route: {plan.route.why}")
    for line in plan.providers.describe():
        print(f"  {line}")
    print("\nmemory plan:")
    if plan.memory is not None:
        print(f"  context {plan.memory.context_length} tokens, batch {plan.memory.batch_size}")
        print(f"  {plan.memory.describe()}")
    else:
        print(f"  none: {plan.memory_error}")  # the budget, or a load that failed


_PROBE = """
import json, sys
import edgeinfer
import edgeinfer.cli  # the modules an `edgeinfer run` process holds, for the same size
from edgeinfer.errors import EdgeInferError
spec = json.loads(sys.stdin.read())
try:
    with edgeinfer.load(spec.pop("model"), **spec) as model:
        print(json.dumps({"plan": model.info["memory_plan"]}))
except EdgeInferError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def _loaded_plan(args: argparse.Namespace) -> tuple[MemoryPlan | None, str | None]:
    """The plan `edgeinfer run` gets with the same flags: a fresh process loads the model
    (the plan is fitted again to what the loaded weights really take) and reports it."""
    spec = {
        "model": str(args.model),
        "device": args.device,
        "allow_fallback": args.allow_fallback,
        "memory_budget": args.memory_budget,
        "context_length": args.context_length,
    }
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {}
    if "plan" in result:
        known = {f.name for f in fields(MemoryPlan)}
        return MemoryPlan(**{k: v for k, v in result["plan"].items() if k in known}), None
    if "error" in result:
        return None, str(result["error"])
    return None, f"the model did not load (exit {done.returncode}); run it with --debug"


def _memory(
    source: Any, machine: Machine, args: argparse.Namespace
) -> tuple[MemoryPlan | None, str | None, Route | None]:
    """The memory plan (or why there is none) and the route it settled on: on this machine
    exactly what a run gets; on a recorded one, ``load()``'s own rules (``load_plan``)."""
    if machine.inventory is None:
        return (*_loaded_plan(args), None)
    config = LoadConfig(device=args.device, context_length=args.context_length)
    budget = MemoryBudget.of(args.memory_budget)
    try:
        route, plan = plan_load(args.model, source, config, budget, machine)
    except EdgeInferError as exc:
        return None, str(exc), None
    return plan, None, route


# A record is a few kilobytes (a large server's /proc/cpuinfo, a few hundred).
_MAX_RECORD_BYTES = 16 << 20


def _recorded(path: Path) -> DeviceInventory:
    """The machine recorded in ``path`` (``--record``'s format, bounded and checked)."""
    try:
        record = read_json_file(path, max_bytes=_MAX_RECORD_BYTES, error=InvalidRequestError)
        return build_inventory(RecordedProbe(record))
    except (InvalidRequestError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequestError(f"--inventory {path}: not a recorded machine ({exc})") from exc


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _platform(inv: DeviceInventory) -> str:
    """The platform the policy sees (jetson, apple-silicon, ...), when it adds something."""
    return "" if inv.platform in (inv.os, "") else f" ({inv.platform})"


# Sources that name a device without asking it: the CPU model string or the chip family
# (an NPU), or the whole RAM standing in for an integrated GPU's memory.
_INFERRED = {"cpu model": "the CPU model", "soc": "the chip", "tegra": "the board"}


def _accelerator(a: Any) -> str:
    inferred = _INFERRED.get(a.source)
    notes = []
    if a.memory_bytes:
        notes.append(_gib(a.memory_bytes) + (" shared RAM" if inferred else ""))
    if inferred:
        notes.append(f"inferred from {inferred}, not probed")
    return a.name + (f" ({'; '.join(notes)})" if notes else "")


def _rows(inv: DeviceInventory) -> list[tuple[str, str]]:
    gpus = ", ".join(_accelerator(g) for g in inv.gpus)
    llama = "not installed"
    if inv.llama_cpp_version is not None:
        names = ", ".join(d.name for d in inv.llama_devices) or "?"
        offload = "yes" if inv.llama_gpu_offload else "no"
        llama = f"{inv.llama_cpp_version}, GPU offload {offload}; devices: {names}"
    ort = "not installed"
    if inv.onnxruntime_version is not None:
        ort = f"{inv.onnxruntime_version}: {', '.join(inv.ort_providers)}"
    rows = [
        ("system", f"{inv.os} {inv.os_release} {inv.arch}" + _platform(inv)),
        ("board", inv.board or "-"),
        ("cpu", f"{inv.cpu_model}, {inv.physical_cores} cores / {inv.logical_cores} threads"),
        ("features", " ".join(inv.cpu_features) or "-"),
        ("memory", f"{_gib(inv.total_ram)} total, {_gib(inv.available_ram)} available"),
        ("gpus", gpus or "none found"),
        ("npus", ", ".join(_accelerator(n) for n in inv.npus) or "none found"),
        ("onnxruntime", ort),
        ("llama.cpp", llama),
    ]
    rows.append(("packages", _packages_row(inv)))
    if inv.openvino_devices:
        rows.append(("openvino", ", ".join(inv.openvino_devices)))
    return rows


def _packages_row(inv: DeviceInventory) -> str:
    if inv.packages is not None:
        return ", ".join(inv.packages) or f"none of {', '.join(PACKAGES)}"
    return _assumed(inv)


def _assumed(inv: DeviceInventory) -> str:
    """What a record without its packages is taken to have, said as an assumption."""
    names = [p for p in PACKAGES if p in inv.installed_packages]
    return (
        f"not recorded (an older record); assumed {', '.join(names) or 'none'} from its "
        "engines (onnx with onnxruntime, as the [onnx] extra installs them)"
    )
