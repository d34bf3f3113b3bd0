"""One ONNX sequence's KV cache as bytes, and back.

The payload is each cache tensor in graph order (``past_key_values.0.key``, ``.0.value``,
...), each as [kv_heads, n_tokens, head_dim] in the cache's dtype: exactly
``2 x layers x kv_heads x n_tokens x head_dim x itemsize`` bytes. A shared cache's slot row is
read in place, one head at a time (no second copy of the KV in memory); a growing cache gets
new values of the restored length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from edgeinfer.errors import SnapshotError

__all__ = ["OnnxKVState"]


class OnnxKVState:
    """``KVState`` of an ``OrtBackend`` (its ``kv_state()``): the backend's own part, reading
    its cache buffers."""

    copies_on_restore = False  # the shared cache is read in place
    whole_only = False

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    @property
    def bytes_per_token(self) -> int:
        return int(self._backend._kv_bytes_per_token)

    def layout(self) -> dict[str, Any]:
        """The settings a sequence's KV depends on (the fingerprint's backend part)."""
        b = self._backend
        arch = b._arch
        return {
            "kv_dtype": np.dtype(b._kv_type).name,
            "layers": int(arch.num_layers),
            "kv_heads": int(arch.num_kv_heads),
            "head_dim": int(arch.head_dim),
            "n_ctx": int(b._n_ctx),
            "batch": int(b._chunk),
            "kv_cache": "shared" if b._shared else "growing",
        }

    def payload_band(self, n_tokens: int) -> tuple[int, int]:
        size = self.bytes_per_token * n_tokens
        return size, size

    def save(self, slot: int) -> list[np.ndarray]:
        """Copies of slot ``slot``'s cache tensors, each [kv_heads, n, head_dim]."""
        b = self._backend
        b._alive()
        n = b._slot_past[slot]
        if b._shared:
            return [np.ascontiguousarray(a[slot, :, :n, :]) for a in b._cache.arrays]
        return [np.ascontiguousarray(v.numpy()[0, :, :n, :]) for v in b._past]

    def load(
        self, slot: int, n_tokens: int, nbytes: int, read: Callable[[memoryview], None]
    ) -> None:
        """Fill slot ``slot`` with ``n_tokens`` tokens of KV from ``read`` (``nbytes`` in
        all); the slot is left empty on failure."""
        b = self._backend
        b._alive()
        expected = self.payload_band(n_tokens)[0]
        if nbytes != expected or n_tokens > b._n_ctx:
            raise SnapshotError(
                f"{nbytes} bytes cannot be {n_tokens} tokens of this model's KV "
                f"({expected} expected)"
            )
        b.rewind(0, slot)
        try:
            if b._shared:
                for array in b._cache.arrays:
                    for head in range(array.shape[1]):
                        read(memoryview(array[slot, head, :n_tokens, :]))
            else:
                arch = b._arch
                shape = (1, arch.num_kv_heads, n_tokens, arch.head_dim)
                values = []
                for _ in b._past_names:
                    value = np.empty(shape, b._kv_type)
                    read(memoryview(value))
                    values.append(b._ort.OrtValue.ortvalue_from_numpy(value))
                b._past = values
        except BaseException:
            b.rewind(0, slot)
            raise
        b._slot_past[slot] = n_tokens
