"""The graph being written: nodes, initializers, and the external-data file the weights go
to as they arrive (the graph never holds them).

A large initializer is a ``Region`` of the data file, reserved when the graph names it and
filled in pieces after (a band of rows at a time, see ``tensors.spans``), so no whole weight
is ever held in memory; the file's layout is the order of reservation."""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any

import numpy as np

from edgeinfer.errors import ConversionError

__all__ = ["Graph", "Region"]

_INLINE_BYTES = 1024  # smaller constants stay in the graph: shape inference reads them
_DATA_ALIGN = 64  # offsets in the data file, bytes


class Region:
    """One initializer's values [shape] of ``dtype``, written in pieces at element offsets
    (flat, C order): straight into the data file, or, under ``_INLINE_BYTES``, into a buffer
    that becomes the graph's own copy at ``done()``."""

    def __init__(self, graph: Graph, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.name, self.shape, self.dtype = name, shape, np.dtype(dtype)
        self.size = int(np.prod(shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self._graph = graph
        self._written = 0
        self._at = len(graph.initializers)
        self._buffer: np.ndarray | None = None
        self._offset = -1
        if self.nbytes < _INLINE_BYTES:  # a place kept in the initializers' order
            self._buffer = np.zeros(self.size, self.dtype)
            graph.initializers.append(graph.placeholder(name))
        else:
            self._offset = graph.external(self)

    def write(self, at: int, values: np.ndarray) -> None:
        """``values`` (any shape, this region's dtype) from element ``at`` on."""
        flat = np.ascontiguousarray(values, self.dtype).reshape(-1)
        if at < 0 or at + flat.size > self.size:
            raise ConversionError(f"{self.name}: {flat.size} values at {at} overrun {self.size}")
        if self._buffer is not None:
            self._buffer[at : at + flat.size] = flat
        else:
            data = self._graph.data
            data.seek(self._offset + at * self.dtype.itemsize)
            data.write(flat.view(np.uint8))  # the array's own bytes: no copy
        self._written += flat.size

    def write_columns(self, column: int, values: np.ndarray) -> None:
        """``values`` [r, m] as columns ``column .. column + r`` of this [m, n] region (a
        weight written transposed as its rows arrive)."""
        n = self.shape[1]
        by_column = np.ascontiguousarray(values.T, self.dtype)  # [m, r]
        for j, line in enumerate(by_column):
            self.write(j * n + column, line)

    def read(self, at: int, count: int) -> np.ndarray:
        """``count`` values from element ``at``, as written so far."""
        if self._buffer is not None:
            return self._buffer[at : at + count].copy()
        data = self._graph.data
        data.seek(self._offset + at * self.dtype.itemsize)
        return np.frombuffer(data.read(count * self.dtype.itemsize), self.dtype)

    def copy_from(self, other: Region, band: int = 1 << 22) -> None:
        """All of ``other``'s values (the same count), ``band`` at a time; then ``done()``."""
        for at in range(0, other.size, band):
            self.write(at, other.read(at, min(band, other.size - at)))
        self.done()

    def done(self) -> None:
        """Every value written: an inline region becomes its initializer."""
        if self._written != self.size:
            raise ConversionError(f"{self.name}: {self._written} of {self.size} values written")
        if self._buffer is not None:
            value = self._buffer.reshape(self.shape)
            self._graph.initializers[self._at] = self._graph.numpy_helper.from_array(
                value, self.name
            )
            self._buffer = None


class Graph:
    """Nodes and initializers in the order they are added; node and output names made unique
    by one counter."""

    def __init__(self, data: IO[bytes], data_name: str) -> None:
        from onnx import helper, numpy_helper

        self.helper = helper
        self.numpy_helper = numpy_helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0
        self.data = data
        self._data_name = data_name
        self._end = data.tell()  # bytes of the data file reserved so far
        self._made: dict[tuple[Any, ...], str] = {}

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def once(self, key: tuple[Any, ...], make: Callable[[], str]) -> str:
        """``make()``'s value, made the first time ``key`` is asked for and reused after."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def placeholder(self, name: str) -> Any:
        """An empty initializer ``name``, holding its place until its values are known."""
        from onnx import TensorProto

        return TensorProto(name=name)

    def reserve(self, name: str, shape: tuple[int, ...], dtype: Any) -> Region:
        """An initializer ``name`` whose values are written later, in pieces."""
        return Region(self, name, tuple(int(d) for d in shape), dtype)

    def external(self, region: Region) -> int:
        """``region``'s place in the data file (its offset, bytes), its initializer added."""
        from onnx import TensorProto

        offset = -(-self._end // _DATA_ALIGN) * _DATA_ALIGN
        self._end = offset + region.nbytes
        tensor = TensorProto(name=region.name, dims=region.shape)
        tensor.data_type = self.helper.np_dtype_to_tensor_dtype(region.dtype)
        tensor.data_location = TensorProto.EXTERNAL
        where = (("location", self._data_name), ("offset", offset), ("length", region.nbytes))
        for key, v in where:
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(v)
        self.initializers.append(tensor)
        return offset

    def const(self, name: str, value: np.ndarray) -> str:
        """A constant; large ones go straight to the external-data file."""
        value = np.ascontiguousarray(value)
        if value.nbytes < _INLINE_BYTES:  # the graph's own copy
            self.initializers.append(self.numpy_helper.from_array(value, name))
            return name
        region = self.reserve(name, value.shape, value.dtype)
        region.write(0, value)
        region.done()
        return name

    def ints(self, stem: str, values: list[int]) -> str:
        """A small int64 constant under a fresh name."""
        return self.const(self.name(stem), np.array(values, np.int64))

    def node(
        self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any
    ) -> list[str]:
        outs = [self.name(op) for _ in range(n_out)]
        self.node_named(op, inputs, outs, domain, **attrs)
        return outs

    def node_named(
        self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs: Any
    ) -> None:
        self.nodes.append(
            self.helper.make_node(
                op, inputs, outputs, name=self.name(op + "_node"), domain=domain or None, **attrs
            )
        )
