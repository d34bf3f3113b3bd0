"""Which engine runs a model: llama.cpp on a GGUF file, or onnxruntime on an ONNX graph, and
for a catalog GGUF, which of the two. A pure function of its inputs (``choose_route``).

A catalog GGUF has an exact ONNX transcode (the native builder keeps the file's blocks, built
once into ``$EDGEINFER_HOME/derived``). It runs through that transcode when llama.cpp is not
installed, when the device is one only ONNX Runtime drives (an NPU, DirectML, a named
provider), and on the CPU whenever onnxruntime and onnx are installed (one sequence only
where the transcode reads little more than the file, below). On the CPU, measured
on the default model: one sequence decodes level on both routes on an idle machine, the
transcode reaches its first token in about half the time and loses less speed beside other
work (README "Busy machine"); many sequences (``parallel > 1``) gain more, since one forward
pass over 8 sequences' tokens gives 4.2-5.2x the throughput of one on the ONNX graph and
2.3x on llama.cpp's Q4_1 kernels on this class of CPU (``shared/notes/batching.md``). It
costs memory: the transcode's process peaks higher (323.9 against 199.1 MB in
``benchmarks/results/bench-native.json``). On a GPU llama.cpp keeps the model.

One sequence stays on llama.cpp where the transcode reads far more bytes a step than the file
(``transcode_reads``, from the tensor types: ``gguf_blocks.transcode_reads``). A decode step
reads every weight once, and the exact forms are larger than some blocks: a Q6_K block
becomes 8-bit values with a float32 scale per 16, a Q4_K block gains a float32 scale and
offset per 32. Idle, 2 threads (``benchmarks/results/route_reads.json``): the default model's
Q4_1 transcode reads 1.16x its file and decodes one sequence at 1.09x llama.cpp's; the
Qwen2.5-Coder Q4_K_M files' read 1.39x and 1.40x and decode at 0.94x and 0.59x, while 8
sequences still run 1.85x and 1.49x faster on the transcode.

``route_on(inventory, ...)`` asks the rule for one machine: which of the route's packages it
has and where llama.cpp would run the file there come from its inventory alone, so a recorded
machine (``edgeinfer devices MODEL --inventory FILE``) gets the route ``load()`` takes there.

``engine="llama.cpp"`` or ``engine="onnxruntime"`` (``load()``'s option) overrides the rule;
a GGUF named by its path runs on llama.cpp unless ``engine="onnxruntime"`` is asked, which
only a catalog name can honour (the transcode is built for the catalog's checked file).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..errors import EdgeInferError, InvalidRequestError
from .inventory import DeviceInventory
from .policy import normalise_device, plan_providers

__all__ = ["ENGINES", "Route", "check_engine", "choose_route", "llama_device_on", "route_on"]

ENGINES = ("auto", "llama.cpp", "onnxruntime")
_GGUF_DEVICES = ("auto", "cpu", "cuda", "metal", "gpu")  # the rest are ONNX Runtime's only
_TRANSCODE = "the exact ONNX transcode of the same blocks"
# One sequence runs the transcode only while a step of it reads at most this many times the
# file's bytes (measured: 1.16x decodes faster than llama.cpp, 1.39x and 1.40x slower)
ONE_SEQUENCE_READS = 1.3


@dataclass(frozen=True)
class Route:
    """What runs (``format``), what was named (``source``), and why."""

    format: str  # "gguf" (llama.cpp) | "onnx" (onnxruntime)
    source: str  # the named model's format
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "from": self.source, "why": self.why}


def check_engine(engine: object) -> str:
    """``engine`` if it is one of ``ENGINES``; InvalidRequestError otherwise."""
    if isinstance(engine, str) and engine in ENGINES:
        return engine
    raise InvalidRequestError(
        f"engine={engine!r} is invalid: expected 'auto' (the route rule), 'llama.cpp' or "
        "'onnxruntime'"
    )


def choose_route(
    model_format: str,
    *,
    transcodable: bool,
    parallel: int,
    device: str,
    installed: Collection[str],
    engine: str = "auto",
    llama_device: str = "cpu",
    transcode_reads: float = 1.0,
) -> Route:
    """The route for a ``model_format`` model ("gguf" | "onnx").

    ``transcodable``: a catalog GGUF (its exact ONNX transcode can be built). ``device``: the
    normalised device wish (``policy.normalise_device``). ``installed``: the packages present
    among "llama_cpp", "onnxruntime" and "onnx" (the builder). ``llama_device``: where llama.cpp
    would run this model under ``device`` ("cpu", "cuda", "metal", "gpu").
    ``transcode_reads``: the bytes a step of the transcode reads over the file's.
    """
    engine = check_engine(engine)
    if model_format != "gguf":
        if engine == "llama.cpp":
            raise InvalidRequestError(
                "engine='llama.cpp' runs GGUF files; this is an ONNX model, which runs on "
                "onnxruntime: load the GGUF file, or leave engine='auto'"
            )
        return Route(model_format, model_format, "an ONNX model runs on onnxruntime")
    if engine == "llama.cpp":
        return Route("gguf", "gguf", "engine='llama.cpp' was asked for")
    if engine == "onnxruntime":
        if not transcodable:
            raise InvalidRequestError(
                "engine='onnxruntime' runs a GGUF through its exact ONNX transcode, built only "
                "for catalog models: load it by its catalog name, or convert the file once "
                "(edgeinfer convert FILE -o FOLDER) and load the folder"
            )
        return Route("onnx", "gguf", f"engine='onnxruntime' was asked for: {_TRANSCODE}")
    if not transcodable:
        return Route("gguf", "gguf", "a GGUF file runs on llama.cpp")
    return _catalog_gguf_route(
        parallel, device, frozenset(installed), llama_device, transcode_reads
    )


def route_on(
    inventory: DeviceInventory,
    model_format: str,
    *,
    transcodable: bool,
    parallel: int = 1,
    device: str = "auto",
    engine: str = "auto",
    transcode_reads: float = 1.0,
) -> Route:
    """``choose_route`` for the machine ``inventory`` describes: its packages
    (``DeviceInventory.installed_packages``) and the device its llama.cpp build would run the
    file on (``llama_device_on``). ``device`` is a ``load()`` device argument."""
    wish = normalise_device(device)
    installed = inventory.installed_packages
    llama_device = "cpu"
    if model_format == "gguf" and transcodable and "llama_cpp" in installed:
        llama_device = llama_device_on(inventory, wish)
    return choose_route(
        model_format,
        transcodable=transcodable,
        parallel=parallel,
        device=wish,
        installed=installed,
        engine=engine,
        llama_device=llama_device,
        transcode_reads=transcode_reads,
    )


def llama_device_on(inventory: DeviceInventory, wish: str) -> str:
    """Where llama.cpp would run a GGUF on ``inventory``'s machine under the normalised
    ``wish``: the device of the policy's first candidate ("cpu" when it has none)."""
    if wish not in _GGUF_DEVICES:
        return "cpu"
    try:
        plan = plan_providers(inventory, "gguf", wish)
    except EdgeInferError:  # no llama.cpp, or none of its devices meets the wish
        return "cpu"
    return plan.candidates[0].device if plan.candidates else "cpu"


def _catalog_gguf_route(
    parallel: int, device: str, installed: frozenset[str], llama_device: str, reads: float
) -> Route:
    if "llama_cpp" not in installed:
        return Route("onnx", "gguf", f"llama.cpp is not installed: {_TRANSCODE}")
    if device not in _GGUF_DEVICES:
        return Route("onnx", "gguf", f"device={device!r} is ONNX Runtime's: {_TRANSCODE}")
    if llama_device != "cpu":
        return Route("gguf", "gguf", f"on the {llama_device} GPU: llama.cpp runs the file there")
    if parallel == 1 and device not in ("auto", "cpu"):
        return Route("gguf", "gguf", f"device={device!r}: llama.cpp's GPU build runs the file")
    if parallel == 1 and reads > ONE_SEQUENCE_READS:
        return Route(
            "gguf",
            "gguf",
            f"one sequence on the CPU: {_TRANSCODE} would read {reads:.2f}x the file's bytes a "
            "step (its exact forms of these block types are larger), and llama.cpp decodes "
            "one sequence of the file faster; parallel > 1 or engine='onnxruntime' runs the "
            "transcode",
        )
    missing = [p for p in ("onnxruntime", "onnx") if p not in installed]
    if missing:
        return Route(
            "gguf",
            "gguf",
            f"{_cpu_case(parallel)}: {_TRANSCODE} would run better on this CPU, but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
            "(pip install 'edgeinfer[onnx]'); llama.cpp runs the file",
        )
    return Route("onnx", "gguf", f"{_cpu_case(parallel)}: {_TRANSCODE} {_CPU_WHY[parallel > 1]}")


# Measured on the default model (README "Busy machine" and "Performance"): one sequence on
# the CPU decodes level on both routes idle, the transcode's time to first token is about
# half llama.cpp's and it loses less beside other work; many sequences batch ~2x better on it.
_CPU_WHY = {
    False: "runs better on the CPU than llama.cpp (half the time to first token, decode "
    "level, less slowdown beside other work); engine='llama.cpp' runs the file",
    True: "batches better on this CPU than llama.cpp",
}


def _cpu_case(parallel: int) -> str:
    return f"parallel={parallel}" if parallel > 1 else "one sequence on the CPU"
