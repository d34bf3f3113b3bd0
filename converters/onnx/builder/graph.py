"""The graph being written: nodes, initializers, and the external-data file the weights go
to as they arrive (the graph never holds them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any

import numpy as np

__all__ = ["Graph"]

_INLINE_BYTES = 1024  # smaller constants stay in the graph: shape inference reads them
_DATA_ALIGN = 64  # offsets in the data file, bytes


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
        self._data = data
        self._data_name = data_name
        self._made: dict[tuple[Any, ...], str] = {}

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def once(self, key: tuple[Any, ...], make: Callable[[], str]) -> str:
        """``make()``'s value, made the first time ``key`` is asked for and reused after."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def const(self, name: str, value: np.ndarray) -> str:
        """A constant; large ones go straight to the external-data file."""
        value = np.ascontiguousarray(value)
        if value.nbytes < _INLINE_BYTES:
            self.initializers.append(self.numpy_helper.from_array(value, name))
            return name
        from onnx import TensorProto

        offset = -(-self._data.tell() // _DATA_ALIGN) * _DATA_ALIGN
        self._data.seek(offset)
        self._data.write(value.tobytes())
        tensor = TensorProto(name=name, dims=value.shape)
        tensor.data_type = self.helper.np_dtype_to_tensor_dtype(value.dtype)
        tensor.data_location = TensorProto.EXTERNAL
        for key, v in (("location", self._data_name), ("offset", offset), ("length", value.nbytes)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(v)
        self.initializers.append(tensor)
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
