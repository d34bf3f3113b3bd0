"""Facts about an ONNX graph read from the protobuf without ``onnx``, before any engine opens it.

onnxruntime opens whatever ``location`` a tensor's ``external_data`` names, relative to the
graph's folder. Releases before 1.24 do not check that it stays inside the folder, so a graph
from a stranger could read ``../../secret`` as weights. This walks the protobuf wire format
(memory-mapped; weights are skipped, never read) and returns every location, for the caller
to check before the engine sees the file.

The same walk reads what load-time checks need from the main graph: the element type of each
input, and how many positions the rotary caches hold (``cos_cache`` of GroupQueryAttention and
RotaryEmbedding nodes): a context longer than that loads, then fails mid-reply.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer.bounded_json import open_regular
from edgeinfer.errors import ModelLoadError

__all__ = ["GraphFacts", "external_data_locations", "read_graph_facts"]

# message kind -> {field number: message kind of that field}, for the fields that can hold a
# TensorProto somewhere below them (onnx.proto3: ModelProto, GraphProto, FunctionProto,
# NodeProto, AttributeProto, SparseTensorProto, TensorProto, StringStringEntryProto).
_SCHEMA: dict[str, dict[int, str]] = {
    "model": {7: "graph", 25: "function"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},
    "entry": {},
}
_MAX_DEPTH = 64  # nested subgraphs (If/Loop bodies); real models nest a few levels
_GRAPH_INPUT = 11  # GraphProto.input (ValueInfoProto)
# contrib operators that read a rotary cache: op type -> index of its cos_cache input
_ROTARY_CACHE_INPUT = {"GroupQueryAttention": 7, "RotaryEmbedding": 2}


@dataclass
class GraphFacts:
    """What the load checks need, read from the file without an engine."""

    locations: list[str] = field(default_factory=list)  # external data files, in order
    input_types: dict[str, int] = field(default_factory=dict)  # main graph input -> elem type
    initializer_rows: dict[str, int] = field(default_factory=dict)  # name -> first dim
    rotary_caches: list[str] = field(default_factory=list)  # cos_cache names rotary nodes read

    @property
    def rotary_positions(self) -> int | None:
        """Positions the smallest rotary cache holds; None when the graph has no rotary node
        reading a stored cache (its rotation is computed, unbounded)."""
        rows = [self.initializer_rows[n] for n in self.rotary_caches if n in self.initializer_rows]
        return min(rows) if rows else None


class _Walker:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path = buf, path
        self.facts = GraphFacts()

    def fail(self, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is not a valid ONNX file ({why}); re-convert it")

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        value = shift = 0
        while shift < 64:
            if pos >= end:
                raise self.fail("truncated")
            byte = self.buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7
        raise self.fail("varint too long")

    def fields(self, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """(field number, wire type, value or start, end) of each field in buf[pos:end]:
        a varint's value (end unused), or a length-delimited field's span."""
        while pos < end:
            tag, pos = self.varint(pos, end)
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                value, pos = self.varint(pos, end)
                yield number, wire, value, pos
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                length, pos = self.varint(pos, end)
                if length > end - pos:
                    raise self.fail("a field runs past its message")
                yield number, wire, pos, pos + length
                pos += length
            else:
                raise self.fail(f"wire type {wire}")
        if pos != end:
            raise self.fail("a field runs past its message")

    def text(self, start: int, end: int) -> str:
        return bytes(self.buf[start:end]).decode("utf-8", errors="replace")

    def message(self, kind: str, pos: int, end: int, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise self.fail("graphs nested too deeply")
        children, entry = _SCHEMA[kind], {}
        main_graph = kind == "graph" and depth == 1
        for number, wire, start, stop in self.fields(pos, end):
            if wire != 2:
                continue
            if number in children:
                self.message(children[number], start, stop, depth + 1)
            elif kind == "entry" and number in (1, 2):
                entry[number] = bytes(self.buf[start:stop])
            if main_graph:
                self.main_graph_field(number, start, stop)
        if entry.get(1) == b"location":
            self.facts.locations.append(entry.get(2, b"").decode("utf-8", errors="replace"))

    def main_graph_field(self, number: int, start: int, stop: int) -> None:
        if number == 1:
            self.node(start, stop)
        elif number == 5:
            self.initializer(start, stop)
        elif number == _GRAPH_INPUT:
            self.graph_input(start, stop)

    def node(self, pos: int, end: int) -> None:
        inputs: list[str] = []
        op = domain = ""
        for number, wire, start, stop in self.fields(pos, end):
            if wire == 2 and number == 1:
                inputs.append(self.text(start, stop))
            elif wire == 2 and number == 4:
                op = self.text(start, stop)
            elif wire == 2 and number == 7:
                domain = self.text(start, stop)
        at = _ROTARY_CACHE_INPUT.get(op)
        if domain == "com.microsoft" and at is not None and len(inputs) > at and inputs[at]:
            self.facts.rotary_caches.append(inputs[at])

    def initializer(self, pos: int, end: int) -> None:
        dims: list[int] = []
        name = None
        for number, wire, start, stop in self.fields(pos, end):
            if number == 1 and wire == 0:
                dims.append(start)
            elif number == 1 and wire == 2:  # packed dims
                at = start
                while at < stop:
                    value, at = self.varint(at, stop)
                    dims.append(value)
            elif number == 8 and wire == 2:
                name = self.text(start, stop)
        if name is not None and dims:
            self.facts.initializer_rows[name] = dims[0]

    def graph_input(self, pos: int, end: int) -> None:
        """ValueInfoProto: name (1), type (2) -> TypeProto.tensor_type (1) -> elem_type (1)."""
        name, elem = None, None
        for number, wire, start, stop in self.fields(pos, end):
            if number == 1 and wire == 2:
                name = self.text(start, stop)
            elif number == 2 and wire == 2:
                elem = self.first_varint(self.first_span(start, stop, 1), 1)
        if name is not None and elem is not None:
            self.facts.input_types[name] = elem

    def first_span(self, pos: int, end: int, number: int) -> tuple[int, int] | None:
        for n, wire, start, stop in self.fields(pos, end):
            if n == number and wire == 2:
                return start, stop
        return None

    def first_varint(self, span: tuple[int, int] | None, number: int) -> int | None:
        if span is None:
            return None
        for n, wire, value, _ in self.fields(*span):
            if n == number and wire == 0:
                return value
        return None


def _open_regular(path: Path) -> int:
    """A descriptor of ``path``, known to be a non-empty regular file (``open_regular``'s
    checks, and a graph of no bytes is a broken conversion)."""
    fd = open_regular(path, error=ModelLoadError, what="the model file")
    if os.fstat(fd).st_size == 0:
        os.close(fd)
        raise ModelLoadError(f"{path} is empty; re-convert the model")
    return fd


def read_graph_facts(path: Path) -> GraphFacts:
    """External data locations, input types and rotary caches of the ONNX file ``path``."""
    fd = _open_regular(path)
    try:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
            walker = _Walker(buf, path)
            walker.message("model", 0, len(buf), 0)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    facts = walker.facts
    facts.locations = list(dict.fromkeys(facts.locations))
    return facts


def external_data_locations(path: Path) -> list[str]:
    """Every external data ``location`` in the ONNX file ``path`` (duplicates removed)."""
    return read_graph_facts(path).locations
