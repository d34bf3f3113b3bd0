"""The builder's entry point: open the source, make the build context, write the decoder
graph (``decoder``) and save it beside the weights already in its data file."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from edgeinfer.files.gguf_file import GGUFHeader, read_gguf_header

from .arch import architecture, gguf_shape
from .context import BuildContext, BuildReport, Quant, check_kv_dtype
from .decoder import decoder, graph_values
from .graph import Graph
from .tensors import GGUFTensors, TensorSource

__all__ = ["build_onnx_from_gguf"]

_DATA_FILE = "model.onnx.data"


class _Progress:
    """Counts the source's tensors as they are read, for ``on_progress(done, total)``."""

    def __init__(self, on_progress: Callable[[int, int], None] | None) -> None:
        self.on_progress = on_progress
        self.done = 0
        self.total = 0

    def __call__(self) -> None:
        self.done += 1
        if self.on_progress is not None:
            self.on_progress(self.done, self.total)


def build_onnx_from_gguf(
    src: str | Path,
    out_dir: str | Path,
    *,
    quant: str = "keep",
    head_bits: int | None = None,
    max_context: int | None = None,
    kv_dtype: str = "float32",
    on_progress: Callable[[int, int], None] | None = None,
) -> BuildReport:
    """Write ``model.onnx`` + ``model.onnx.data`` for ``src`` — a GGUF file, or a Hugging Face
    folder with safetensors weights — into ``out_dir`` (which must exist).

    ``quant``: ``keep`` the source's weights exactly (GGUF blocks transcoded, floats as
    floats; block types without an exact form are widened), re-round every projection to
    symmetric ``int4``/``int8`` blocks (``head_bits=8`` keeps the embedding and the output
    projection at 8 bits), or widen everything to ``fp32``. ``on_progress(done, total)``
    counts the source's tensors as they are written. ``kv_dtype="float16"`` makes the KV
    cache (past/present) halves: half its memory, attention computed on halves. Returns what
    was kept in blocks and what was widened."""
    chosen = Quant(quant, head_bits)
    kv_dtype = check_kv_dtype(kv_dtype)
    out, src = Path(out_dir), Path(src)
    progress = _Progress(on_progress)
    with contextlib.ExitStack() as stack:
        header, tensors = _open_source(stack, src, progress)
        progress.total = len(header.tensors)
        data = stack.enter_context(open(out / _DATA_FILE, "w+b"))  # a tied head reads back
        return _build(header, tensors, out, data, chosen, max_context, kv_dtype)


def _open_source(
    stack: contextlib.ExitStack, src: Path, progress: Callable[[], None]
) -> tuple[GGUFHeader, TensorSource]:
    if src.is_dir():
        from edgeinfer.converters.sources.hf_source import checkpoint_tensors

        return stack.enter_context(checkpoint_tensors(src, progress))
    header = read_gguf_header(src)
    return header, GGUFTensors(header, progress)


def _build(
    header: GGUFHeader,
    tensors: TensorSource,
    out: Path,
    data: IO[bytes],
    quant: Quant,
    max_context: int | None,
    kv_dtype: str,
) -> BuildReport:
    graph = Graph(data, _DATA_FILE)
    shape = gguf_shape(header)  # the header's checks, before anything is read
    context = min(max_context or shape.context, shape.context)
    report = BuildReport(header.architecture, shape.layers, {}, {}, context, shape, kv_dtype)
    b = BuildContext(tensors, shape, architecture(header), quant, context, graph, report, kv_dtype)
    graph.node_named("Identity", [decoder(b)], ["logits"])
    for t in header.tensors:  # tensors the graph does not use (rope_freqs, ...) count as done
        if t.name not in tensors.seen:
            tensors.seen.add(t.name)
            tensors.on_read()
    _save(b, out / "model.onnx")
    return report


def _save(b: BuildContext, path: Path) -> None:
    """The graph, its weights already in the data file."""
    import onnx

    helper = b.graph.helper
    inputs, outputs = graph_values(b)
    graph = helper.make_graph(
        b.graph.nodes, "edgeinfer-decoder", inputs, outputs, b.graph.initializers
    )
    model: Any = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        producer_name="edgeinfer",
    )
    model.ir_version = 10
    onnx.save_model(model, str(path))
