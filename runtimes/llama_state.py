"""One llama.cpp sequence's KV cache as bytes, and back (llama.cpp's per-sequence state API).

``llama_state_seq_get_data`` writes the sequence's cells (positions, then each layer's K and V
rows) into a buffer; ``llama_state_seq_set_data`` reads them into an emptied sequence. What
llama.cpp writes besides the K and V rows is small and grows with the tokens (a position and
a count per cell, a type and a row size per layer), so a payload's size is checked against a
band below every layer's KV bytes before it reaches llama.cpp, after its checksum holds;
llama.cpp's reader also checks every read against the buffer's end, and the restored cells
must be exactly the snapshot's tokens.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from edgeinfer.errors import SnapshotError

__all__ = ["layout", "load_seq", "payload_band", "save_seq", "whole_only"]

COPIES_ON_RESTORE = True  # llama.cpp takes the state as one buffer
_CELL_OVERHEAD = 64  # bytes per cell beyond its K and V rows: llama.cpp writes ~8
_FIXED_OVERHEAD = 1 << 16  # per-layer types and row sizes, stream headers


def layout(backend: Any) -> dict[str, Any]:
    """The settings a sequence's KV depends on (the fingerprint's backend part)."""
    return {
        "kv_type": "f32" if backend._kv_dtype == "float32" else "f16",
        "flash_attention": bool(backend._flash_attention),
        "n_ctx": int(backend._n_ctx),
        "batch": int(backend._chunk),
        "kv_unified": bool(backend._unified),
        "swa_full": True,
        "gpu_layers": int(backend._info.get("n_gpu_layers", 0)),
        "whole_only": whole_only(backend),
        # a context of n sequences keeps n KV streams, and its sequence state says so: one
        # of another parallel is refused by llama.cpp (read 0 bytes)
        "parallel": int(backend._n_slots),
    }


def whole_only(backend: Any) -> bool:
    """Whether a restored state can only be reused whole: with sliding-window layers,
    llama.cpp's sequence state keeps those layers' entries of the last window only, so a
    rewind into it would lose entries the next tokens attend to."""
    return int(backend._llama.llama_model_n_swa(backend._model)) > 0


def kv_bytes_per_token(backend: Any) -> int:
    return int(backend._kv_nbytes // (backend._n_ctx * backend._n_slots))


def payload_band(backend: Any, n_tokens: int) -> tuple[int, int]:
    """The least and most bytes a sequence of ``n_tokens`` takes in llama.cpp's state: at
    most every layer's K and V rows for every token, plus the cells' bookkeeping; at least
    a position per cell (sliding-window layers keep only the window's cells, so a Gemma 3
    state is smaller than its tokens times every layer's rows)."""
    kv = kv_bytes_per_token(backend) * n_tokens
    return 4 * n_tokens, kv + _CELL_OVERHEAD * n_tokens + _FIXED_OVERHEAD


def save_seq(backend: Any, slot: int) -> bytearray:
    """A copy of slot ``slot``'s state (its cells and their K and V)."""
    backend._require_open()
    llama, ctx = backend._llama, backend._ctx
    size = int(llama.llama_state_seq_get_size(ctx, slot))
    buf = bytearray(size)
    written = llama.llama_state_seq_get_data(
        ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, slot
    )
    if written != size:
        raise SnapshotError(f"llama.cpp wrote {written} of {size} bytes of the sequence's state")
    return buf


def load_seq(
    backend: Any, slot: int, n_tokens: int, nbytes: int, read: Callable[[memoryview], None]
) -> None:
    """Empty slot ``slot``, then fill it with ``nbytes`` of state holding ``n_tokens`` cells
    (``read`` fills a buffer from the file, checking it); the slot is left empty on failure."""
    low, high = payload_band(backend, n_tokens)
    if not low <= nbytes <= high or n_tokens > backend._n_ctx:
        raise SnapshotError(
            f"{nbytes} bytes of state cannot hold {n_tokens} tokens of this model's KV"
        )
    backend.rewind(0, slot)
    buf = bytearray(nbytes)
    read(memoryview(buf))
    verify = getattr(read, "verify", None)
    if verify is not None:  # the checksum holds before a byte reaches llama.cpp
        verify()
    llama, ctx = backend._llama, backend._ctx
    used = llama.llama_state_seq_set_data(
        ctx, (ctypes.c_uint8 * nbytes).from_buffer(buf), nbytes, slot
    )
    top = int(llama.llama_memory_seq_pos_max(backend._memory, slot))
    if used != nbytes or top != n_tokens - 1:
        llama.llama_memory_seq_rm(backend._memory, slot, 0, -1)
        raise SnapshotError(
            f"llama.cpp did not take the snapshot's state (read {used} of {nbytes} bytes, "
            f"{top + 1} of {n_tokens} tokens)"
        )
    backend._past[slot] = n_tokens
