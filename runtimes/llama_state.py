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

__all__ = ["LlamaKVState"]

_CELL_OVERHEAD = 64  # bytes per cell beyond its K and V rows: llama.cpp writes ~8
_FIXED_OVERHEAD = 1 << 16  # per-layer types and row sizes, stream headers


class LlamaKVState:
    """``KVState`` of a ``LlamaCppBackend`` (its ``kv_state()``): the backend's own part,
    reading its context and memory handles."""

    copies_on_restore = True  # llama.cpp takes the state as one buffer

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    @property
    def bytes_per_token(self) -> int:
        b = self._backend
        return int(b._kv_nbytes // (b._n_ctx * b._n_slots))

    @property
    def whole_only(self) -> bool:
        """With sliding-window layers llama.cpp's sequence state keeps those layers' entries
        of the last window only, so a rewind into it would lose entries the next tokens
        attend to."""
        b = self._backend
        return int(b._llama.llama_model_n_swa(b._model)) > 0

    def layout(self) -> dict[str, Any]:
        """The settings a sequence's KV depends on (the fingerprint's backend part)."""
        b = self._backend
        return {
            "kv_type": "f32" if b._kv_dtype == "float32" else "f16",
            "flash_attention": bool(b._flash_attention),
            "n_ctx": int(b._n_ctx),
            "batch": int(b._chunk),
            "kv_unified": bool(b._unified),
            "swa_full": True,
            "gpu_layers": int(b._info.get("n_gpu_layers", 0)),
            "whole_only": self.whole_only,
            # a context of n sequences keeps n KV streams, and its sequence state says so:
            # one of another parallel is refused by llama.cpp (read 0 bytes)
            "parallel": int(b._n_slots),
        }

    def payload_band(self, n_tokens: int) -> tuple[int, int]:
        """At most every layer's K and V rows for every token, plus the cells' bookkeeping;
        at least a position per cell (sliding-window layers keep only the window's cells, so
        a Gemma 3 state is smaller than its tokens times every layer's rows)."""
        kv = self.bytes_per_token * n_tokens
        return 4 * n_tokens, kv + _CELL_OVERHEAD * n_tokens + _FIXED_OVERHEAD

    def save(self, slot: int) -> list[bytearray]:
        """A copy of slot ``slot``'s state (its cells and their K and V)."""
        b = self._backend
        b._require_open()
        llama, ctx = b._llama, b._ctx
        size = int(llama.llama_state_seq_get_size(ctx, slot))
        buf = bytearray(size)
        written = llama.llama_state_seq_get_data(
            ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, slot
        )
        if written != size:
            raise SnapshotError(
                f"llama.cpp wrote {written} of {size} bytes of the sequence's state"
            )
        return [buf]

    def load(
        self, slot: int, n_tokens: int, nbytes: int, read: Callable[[memoryview], None]
    ) -> None:
        """Empty slot ``slot``, then fill it with ``nbytes`` of state holding ``n_tokens``
        cells (``read`` fills a buffer from the file, checking it); the slot is left empty
        on failure."""
        b = self._backend
        low, high = self.payload_band(n_tokens)
        if not low <= nbytes <= high or n_tokens > b._n_ctx:
            raise SnapshotError(
                f"{nbytes} bytes of state cannot hold {n_tokens} tokens of this model's KV"
            )
        b.rewind(0, slot)
        buf = bytearray(nbytes)
        read(memoryview(buf))
        verify = getattr(read, "verify", None)
        if verify is not None:  # the checksum holds before a byte reaches llama.cpp
            verify()
        llama, ctx = b._llama, b._ctx
        used = llama.llama_state_seq_set_data(
            ctx, (ctypes.c_uint8 * nbytes).from_buffer(buf), nbytes, slot
        )
        top = int(llama.llama_memory_seq_pos_max(b._memory, slot))
        if used != nbytes or top != n_tokens - 1:
            llama.llama_memory_seq_rm(b._memory, slot, 0, -1)
            raise SnapshotError(
                f"llama.cpp did not take the snapshot's state (read {used} of {nbytes} bytes, "
                f"{top + 1} of {n_tokens} tokens)"
            )
        b._past[slot] = n_tokens
