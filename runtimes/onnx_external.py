"""The external data files an ONNX graph names, read from the protobuf without ``onnx``.

onnxruntime opens whatever ``location`` a tensor's ``external_data`` names, relative to the
graph's folder. Releases before 1.24 do not check that it stays inside the folder, so a graph
from a stranger could read ``../../secret`` as weights. This walks the protobuf wire format
(memory-mapped; weights are skipped, never read) and returns every location, for the caller
to check before the engine sees the file.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from edgeinfer.errors import ModelLoadError

__all__ = ["external_data_locations"]

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


class _Walker:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path = buf, path
        self.locations: list[str] = []

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

    def message(self, kind: str, pos: int, end: int, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise self.fail("graphs nested too deeply")
        fields, entry = _SCHEMA[kind], {}
        while pos < end:
            tag, pos = self.varint(pos, end)
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                _, pos = self.varint(pos, end)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                length, pos = self.varint(pos, end)
                if length > end - pos:
                    raise self.fail("a field runs past its message")
                if number in fields:
                    self.message(fields[number], pos, pos + length, depth + 1)
                elif kind == "entry" and number in (1, 2):
                    entry[number] = bytes(self.buf[pos : pos + length])
                pos += length
            else:
                raise self.fail(f"wire type {wire}")
        if pos != end:
            raise self.fail("a field runs past its message")
        if entry.get(1) == b"location":
            self.locations.append(entry.get(2, b"").decode("utf-8", errors="replace"))


def external_data_locations(path: Path) -> list[str]:
    """Every external data ``location`` in the ONNX file ``path`` (duplicates removed)."""
    try:
        with path.open("rb") as fh:
            if path.stat().st_size == 0:
                raise ModelLoadError(f"{path} is empty; re-convert the model")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                walker = _Walker(buf, path)
                walker.message("model", 0, len(buf), 0)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return list(dict.fromkeys(walker.locations))
