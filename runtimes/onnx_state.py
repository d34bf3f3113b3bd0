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

__all__ = ["layout", "load_seq", "payload_band", "save_seq"]


def layout(backend: Any) -> dict[str, Any]:
    """The settings a sequence's KV depends on (the fingerprint's backend part)."""
    arch = backend._arch
    return {
        "kv_dtype": np.dtype(backend._kv_type).name,
        "layers": int(arch.num_layers),
        "kv_heads": int(arch.num_kv_heads),
        "head_dim": int(arch.head_dim),
        "n_ctx": int(backend._n_ctx),
        "batch": int(backend._chunk),
        "kv_cache": "shared" if backend._shared else "growing",
    }


def payload_band(backend: Any, n_tokens: int) -> tuple[int, int]:
    arch = backend._arch
    itemsize = np.dtype(backend._kv_type).itemsize
    size = 2 * arch.num_layers * arch.num_kv_heads * n_tokens * arch.head_dim * itemsize
    return size, size


def save_seq(backend: Any, slot: int) -> list[np.ndarray]:
    """Copies of slot ``slot``'s cache tensors, each [kv_heads, n, head_dim]."""
    backend._alive()
    n = backend._slot_past[slot]
    if backend._shared:
        return [np.ascontiguousarray(a[slot, :, :n, :]) for a in backend._cache.arrays]
    return [np.ascontiguousarray(v.numpy()[0, :, :n, :]) for v in backend._past]


def load_seq(
    backend: Any, slot: int, n_tokens: int, nbytes: int, read: Callable[[memoryview], None]
) -> None:
    """Fill slot ``slot`` with ``n_tokens`` tokens of KV from ``read`` (``nbytes`` in all);
    the slot is left empty on failure."""
    backend._alive()
    if (nbytes, nbytes) != payload_band(backend, n_tokens) or n_tokens > backend._n_ctx:
        raise SnapshotError(
            f"{nbytes} bytes cannot be {n_tokens} tokens of this model's KV "
            f"({payload_band(backend, n_tokens)[0]} expected)"
        )
    backend.rewind(0, slot)
    try:
        if backend._shared:
            for array in backend._cache.arrays:
                for head in range(array.shape[1]):
                    read(memoryview(array[slot, head, :n_tokens, :]))
        else:
            arch = backend._arch
            shape = (1, arch.num_kv_heads, n_tokens, arch.head_dim)
            values = []
            for _ in backend._past_names:
                value = np.empty(shape, backend._kv_type)
                read(memoryview(value))
                values.append(backend._ort.OrtValue.ortvalue_from_numpy(value))
            backend._past = values
    except BaseException:
        backend.rewind(0, slot)
        raise
    backend._slot_past[slot] = n_tokens
