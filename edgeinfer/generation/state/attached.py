"""A prompt cache as one model's generation loop sees it: restore before a prefill, remember
after one. ``edgeinfer.generation.results`` calls these two methods and knows nothing else of it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .prompt_cache import PromptCache
from .sequence import SeqStates

if TYPE_CHECKING:
    from edgeinfer.generation.results import KVHistory

__all__ = ["AttachedCache"]


class AttachedCache:
    """``cache`` bound to one model's backend (its fingerprint, its memory budget)."""

    def __init__(self, cache: PromptCache, states: SeqStates, budget: int | None) -> None:
        self.cache = cache
        self._states = states
        self._budget = budget

    @classmethod
    def attach(
        cls, cache: PromptCache, backend: Any, model_path: Path, budget: int | None
    ) -> AttachedCache:
        return cls(cache, SeqStates(backend, model_path), budget)

    @property
    def whole_only(self) -> bool:
        return self._states.whole_only

    def restore(self, backend: Any, history: KVHistory, prompt: list[int], slot: int = 0) -> int:
        """Prompt tokens read from disk into ``slot`` for ``prompt`` (0 when none)."""
        return self.cache.restore(self._states, backend, history, prompt, slot, self._budget)

    def remember(self, prompt: list[int], prefilled: int, slot: int = 0) -> None:
        """``slot`` holds ``prompt``'s KV, of which ``prefilled`` tokens were just computed."""
        self.cache.remember(self._states, prompt, prefilled, slot)

    @property
    def stats(self) -> dict[str, Any]:
        return self.cache.stats

    def flush(self, timeout: float | None = None) -> None:
        self.cache.flush(timeout)
