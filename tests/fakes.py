"""A tiny random-weight model behind the Backend protocol, for fast generator tests.

Vocabulary: ids 0..255 are single bytes, then BOS, EOS, then a few multi-byte tokens (whole
UTF-8 characters, and characters split across two tokens). The logits of a position depend on
the whole token history, so mixed-up KV state shows as different output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

BOS = 256
EOS = 257
MULTI_BYTE = ["é".encode(), "中".encode(), "🙂".encode()[:2], "🙂".encode()[2:], b" the"]
VOCAB = 258 + len(MULTI_BYTE)


class FakeTokenizer:
    chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )

    @property
    def n_vocab(self) -> int:
        return VOCAB

    @property
    def bos_token(self) -> str | None:
        return None

    @property
    def eos_token(self) -> str | None:
        return "</s>"

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        if token_id < 258:
            return b""
        return MULTI_BYTE[token_id - 258]

    def is_end_of_generation(self, token_id: int) -> bool:
        return token_id == EOS


class FakeBackend:
    """Logits = W[last token] + P[hash of the whole history]: a random bigram-ish model."""

    def __init__(self, n_ctx: int = 256, seed: int = 0, eos_boost: float = 0.0) -> None:
        rng = np.random.default_rng(seed)
        self._w = rng.normal(0, 3, size=(VOCAB, VOCAB)).astype(np.float32)
        self._p = rng.normal(0, 1, size=(97, VOCAB)).astype(np.float32)
        self._w[:, EOS] += eos_boost
        self._n_ctx = n_ctx
        self.cache: list[int] = []
        self.tokenizer = FakeTokenizer()
        self.prefilled: list[int] = []  # how many tokens each prefill call got
        self.closed = False

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_past(self) -> int:
        return len(self.cache)

    @property
    def reuse_is_exact(self) -> bool:
        return True  # logits are a pure function of the history

    @property
    def kv_nbytes(self) -> int:
        return self._n_ctx * 16

    @property
    def info(self) -> dict[str, Any]:
        return {"backend": "fake", "provider": "numpy", "device": "cpu", "threads": 1}

    def _logits(self) -> np.ndarray:
        h = hash(tuple(self.cache)) % 97
        return self._w[self.cache[-1]] + self._p[h]

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        assert token_ids, "prefill needs tokens"
        assert len(self.cache) + len(token_ids) <= self._n_ctx, "context overflow"
        self.prefilled.append(len(token_ids))
        self.cache.extend(int(t) for t in token_ids)
        return self._logits()

    def decode(self, token_id: int) -> np.ndarray:
        assert len(self.cache) < self._n_ctx, "context overflow"
        self.cache.append(int(token_id))
        return self._logits()

    def rewind(self, n: int) -> None:
        assert 0 <= n <= len(self.cache)
        del self.cache[n:]

    def close(self) -> None:
        self.closed = True


class FakeSlotBackend(FakeBackend):
    """FakeBackend with ``n_slots`` sequences: each slot's logits depend on its own history
    only, so a sequence in a batch gives exactly what it gives alone. ``steps`` records each
    call: ("prefill", slot, n) or ("decode", (slots...))."""

    def __init__(self, n_slots: int = 4, n_ctx: int = 256, seed: int = 0, **kw: Any) -> None:
        super().__init__(n_ctx=n_ctx, seed=seed, **kw)
        self._slot_caches: list[list[int]] = [[] for _ in range(n_slots)]
        self.steps: list[tuple[Any, ...]] = []
        self.fail_next_decode = False
        self.delay = 0.0  # seconds each forward pass takes (a slow engine)
        self.prefill_gate: Any = None  # a threading.Event each prefill waits for, if set

    @property
    def n_slots(self) -> int:
        return len(self._slot_caches)

    def slot_past(self, slot: int) -> int:
        return len(self._slot_caches[slot])

    def _with(self, slot: int) -> None:
        self.cache = self._slot_caches[slot]

    def prefill(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        if self.prefill_gate is not None:
            self.prefill_gate.wait(30)
        self._with(slot)
        self.steps.append(("prefill", slot, len(token_ids)))
        return super().prefill(token_ids)

    def decode(self, token_id: int, slot: int = 0) -> np.ndarray:
        return self.decode_many([(slot, token_id)])[0]

    def rewind(self, n: int, slot: int = 0) -> None:
        self._with(slot)
        super().rewind(n)

    def decode_many(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        if self.fail_next_decode:
            self.fail_next_decode = False
            raise RuntimeError("the engine failed")
        time.sleep(self.delay)
        slots = [s for s, _ in steps]
        assert len(set(slots)) == len(slots), "a slot listed twice"
        self.steps.append(("decode", tuple(slots)))
        rows = []
        for slot, token in steps:
            self._with(slot)
            rows.append(FakeBackend.decode(self, token))
        return np.stack(rows)
