"""Parts of ``Model`` that need no model: token-id checks and signals held over a teardown."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import InvalidRequestError, short_repr
from .generation.sampling import is_int
from .generation.state.attached import AttachedCache
from .generation.state.prompt_cache import PromptCache
from .generation.state.sequence import kv_state_of
from .memory.plan import MemoryPlan

logger = logging.getLogger(__name__)

__all__ = ["attach_cache", "check_flag", "check_overflow", "checked_token_ids", "signals_held"]


def check_flag(value: object, name: str) -> bool:
    """A keyword that must be True or False."""
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name}={value!r} is invalid: expected True or False")
    return value


def check_overflow(context_overflow: object) -> str:
    """``load()``'s ``context_overflow``: "stop" or "slide"."""
    if context_overflow not in ("stop", "slide"):
        raise InvalidRequestError(
            f"context_overflow={context_overflow!r} is invalid: expected 'stop' or 'slide'"
        )
    return str(context_overflow)


def attach_cache(value: Any, backend: Any, path: Path, plan: MemoryPlan | None) -> Any:
    """``load()``'s ``prompt_cache`` bound to this backend (None when there is none, or when
    the backend cannot copy its KV: an embedding model)."""
    cache = PromptCache.of(value)
    if cache is None:
        return None
    if kv_state_of(backend) is None:
        raise InvalidRequestError("prompt_cache: this model's backend cannot save its KV cache")
    attached = AttachedCache.attach(cache, backend, path, plan.budget if plan else None)
    if attached.whole_only:
        logger.warning(
            "prompt_cache is off for %s: llama.cpp keeps only the last window of its "
            "sliding-window layers in a sequence's state, so a prefix of it cannot be reused "
            "exactly (save_state/load_state work)",
            path.name,
        )
        return None
    return attached


def checked_token_ids(values: Sequence[Any], n_vocab: int, what: str) -> list[int]:
    """``values`` as a list of token ids, each an integer (not a bool, a float or a string)
    in ``0..n_vocab-1``; anything else is an InvalidRequestError naming its position."""
    ids: list[int] = []
    for i, value in enumerate(values):
        if not is_int(value):
            raise InvalidRequestError(
                f"{what}[{i}]={short_repr(value, 40)} is not a token id: token ids are integers"
            )
        if not 0 <= value < n_vocab:
            raise InvalidRequestError(
                f"{what}[{i}]={int(value)} is outside the vocabulary (0..{n_vocab - 1})"
            )
        ids.append(int(value))
    return ids


@contextmanager
def signals_held() -> Iterator[None]:
    """Python's SIGINT and SIGTERM handlers (KeyboardInterrupt, an app's own) run after the
    block instead of inside it: an exception raised halfway through an engine's teardown
    leaves native memory half-freed, and the next touch of it is a segmentation fault.
    Handlers can only be swapped on the main thread, where Python runs them all."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    saved: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if callable(handler):  # SIG_DFL and SIG_IGN are the kernel's: nothing to hold
            saved[signum] = handler
            signal.signal(signum, lambda number, _frame: arrived.append(number))
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        for signum in arrived:
            saved[signum](signum, None)
