"""One sequence's generation, and the objects it hands out.

One request: match the prompt against the tokens already in the KV cache, rewind to the
common prefix (``KVHistory``), prefill the rest, then sample -> detokenize -> decode until
EOS, a stop string, ``max_new_tokens``, a full context or a cancel. ``SequenceState`` turns
each position's logits into the next token and text; the loop that drives the backend is
``edgeinfer.generation.scheduler`` (the only one, for every parallelism).

Under a ``response_format`` the grammar ends the reply (``stop``) and stop strings do not
apply; a grammar failure after the first token (an llguidance limit met on this path, or
``logit_bias`` banning every token the grammar allows) raises ``InvalidRequestError`` from
the stream instead of ending it with a finish_reason, so a cut reply never looks finished.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..errors import InvalidRequestError
from ..memory.rss import peak_rss
from .detokenizer import IncrementalDetokenizer
from .sampling import Sampler, SamplingConfig
from .scoring import TokenLogprob, token_logprob

if TYPE_CHECKING:
    from ..runtimes.base import Backend, Tokenizer

__all__ = ["Chunk", "FinishReason", "GenerationResult", "GenerationStats", "TokenStream"]

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]

# Prompt tokens always read again, even when all are in the cache (see KVHistory): the read
# then has at least as many rows as the kernels that change with a batch's size switch at.
MIN_REREAD = 8
# Reuse ends at a multiple of this many tokens (see KVHistory): every prompt token then sits
# at the same place within its batch's row groups as in a fresh read.
REUSE_GRANULE = 32


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int
    reused_prompt_tokens: int  # prompt tokens found in the KV cache and not prefilled again
    ttft_s: float  # request start -> first token's logits available (includes prefill)
    prefill_tokens_per_s: float  # prefilled (non-reused) prompt tokens / prefill time
    decode_tokens_per_s: float  # (n - 1) / (t_last - t_first); 0.0 when n < 2
    total_s: float
    peak_rss_bytes: int = 0  # the process's peak resident set so far (VmHWM); 0 if unknown
    disk_prompt_tokens: int = 0  # prompt tokens whose KV was read from the prompt cache on disk
    draft_tokens: int = 0  # tokens drafted for speculative decoding (checked by the model)
    accepted_tokens: int = 0  # of which kept: tokens that cost no forward pass of their own


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed text; the last chunk of a stream carries finish_reason and stats."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    # calls completed in this chunk (chat with tools), OpenAI's shape: {"id", "type":
    # "function", "function": {"name", "arguments": JSON text}}
    tool_calls: tuple[dict[str, Any], ...] = ()
    # with top_logprobs set: one per id in token_ids (edgeinfer.generation.scoring.TokenLogprob)
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stats: GenerationStats
    # the parsed JSON of a complete reply under a JSON response_format; None otherwise (also
    # when the reply ended before the grammar did)
    parsed: Any = None
    # chat with tools: the calls the reply made, each valid against its function's schema
    # (finish_reason "tool_calls" when it made calls and every one was valid) ...
    tool_calls: tuple[dict[str, Any], ...] = ()
    # ... and why a call in the reply was not handed out (malformed, unknown function,
    # arguments not matching the schema); None when there was none
    tool_call_error: str | None = None
    # under a response_format: the reply ran out of max_new_tokens (or the context) before
    # the format was complete, so its text does not match the format (JSON that does not
    # parse); a warning is logged too
    format_incomplete: bool = False
    # with top_logprobs set: each generated token's log-probability and the likeliest others
    logprobs: tuple[TokenLogprob, ...] = ()


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class KVHistory:
    """Token ids whose entries are in the backend's KV cache, in order (a prefix of it).

    ``batched`` counts the leading entries written by prefill. Entries written by decode
    steps (one token at a time) come from other kernels than a batched read of the same
    tokens (llama.cpp, without flash attention: logits downstream differ by up to ~0.7), so
    they are not reused.

    CPU kernels may treat a batch's rows in groups (repacked and AMX weights: 4, 8 or 16
    rows, the rest one by one), so a token's result can depend on where it sits in its
    batch. Backends cut prefill batches at absolute positions that are multiples of their
    batch size, and reuse ends at a multiple of ``REUSE_GRANULE``: a reused read then puts
    every new token in the same batch position (modulo 32) as a fresh read, and a reused
    cache gives what an empty one gives, on any kernel that groups rows by a power of two up
    to 32.

    Kernels also change with a batch's size: llama.cpp computes K-quant weights (Q4_K, Q5_K,
    Q6_K, ...) with a tiled kernel from 8 rows up and row by row below, and onnxruntime's
    4-bit MatMul takes another kernel for one row; the sums differ (a Q4_K_M file's logits,
    and its greedy replies, after a prompt read whole or with its last tokens apart:
    tests/test_reuse_kquants.py fails under a re-read of 2). So at least
    ``MIN_REREAD`` tokens are read again: the re-read's last batch then has 8 rows or more
    where the fresh read's had, and is the same short batch where it had fewer (both end at
    the prompt's end, and every cut is at a multiple of the batch size). 8 is the switch in
    the llama.cpp that llama-cpp-python vendors, built for the CPU as it is by default (its
    tiled kernel; its ARM float16 kernel too); a build with other kernels (KleidiAI's, which
    switch at 128 rows) is not covered.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.batched = 0
        # > 0 after a snapshot of a model with sliding-window layers was restored: its state
        # holds only the window's entries of those layers, so it is reused whole or not at all
        self.whole = 0

    def clear(self) -> None:
        """Forget every entry (the cache can no longer be trusted: a failed or interrupted
        forward pass)."""
        self.tokens = []
        self.batched = self.whole = 0

    def reuse(self, backend: Backend, prompt: Sequence[int]) -> int:
        """Rewind ``backend`` to the longest common prefix with ``prompt`` among the entries
        prefill wrote; return its length.

        At least ``MIN_REREAD`` prompt tokens (or the whole prompt) are always read again:
        prefill yields the logits, and a batch of fewer rows is computed by other kernels, so
        a repeated prompt would otherwise not give what it gave the first time.
        """
        limit = min(self.batched, len(prompt) - MIN_REREAD, backend.n_past)
        if not backend.reuse_is_exact:
            limit = 0  # the engine's sums depend on how the prompt was split: read it whole
        n = 0
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        n -= n % REUSE_GRANULE
        if n < self.whole:
            n = 0
        self.whole = min(self.whole, n)
        del self.tokens[n:]
        self.batched = n
        backend.rewind(n)
        return n


class TokenStream:
    """Iterator of Chunks for one request; ``cancel()`` may be called from any thread.

    Breaking out of the loop or calling ``close()`` ends generation at once; the model stays
    usable. After the stream ends, ``result`` holds the whole GenerationResult.
    """

    def __init__(
        self,
        chunks: Iterator[Chunk],
        cancel_event: threading.Event,
        parse: Callable[[str, str], Any] | None = None,
    ) -> None:
        self._chunks = chunks
        self._cancel = cancel_event
        self._parse = parse
        self._parts: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self.result: GenerationResult | None = None

    @property
    def cancel_event(self) -> threading.Event:
        """The event that cancels this stream (set by ``cancel()``; shared by a stream that
        wraps this one)."""
        return self._cancel

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> Chunk:
        chunk = next(self._chunks)
        self._parts.append(chunk.text)
        self._ids.extend(chunk.token_ids)
        self._logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None and chunk.stats is not None:
            text = "".join(self._parts)
            parsed = self._parse(text, chunk.finish_reason) if self._parse else None
            cut = self._parse is not None and chunk.finish_reason == "length"
            self.result = GenerationResult(
                text,
                tuple(self._ids),
                chunk.finish_reason,
                chunk.stats,
                parsed,
                format_incomplete=cut,
                logprobs=tuple(self._logprobs),
            )
        return chunk

    def cancel(self) -> None:
        """Ask generation to stop; the stream then ends with finish_reason 'cancelled'."""
        self._cancel.set()

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def collect(self) -> GenerationResult:
        """Run the stream to its end and return the result."""
        for _ in self:
            pass
        assert self.result is not None  # the loop always ends with a final chunk
        return self.result


def check_request(backend: Backend, prompt: Sequence[int], config: SamplingConfig) -> Sampler:
    """Refuse a request that cannot run (before any work); return its sampler."""
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    if len(prompt) >= backend.n_ctx:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens but the context holds {backend.n_ctx} "
            "(with room for at least one new token); shorten the prompt or load the model "
            "with a larger context_length"
        )
    sampler = Sampler(config, backend.tokenizer.n_vocab)
    if config.response_format is not None:  # an invalid grammar is refused here, before work
        from .structured import compile_constraint

        constraint = compile_constraint(config.response_format, backend.tokenizer)
        constraint.ban([i for i, bias in config.logit_bias if bias == -math.inf])
        constraint.allowed()  # refuses a first step whose every allowed token is banned
        sampler.constraint = constraint
    return sampler


@dataclass(frozen=True)
class _Step:
    """What one step did: the token taken (None when the sequence ended without one), its
    text (possibly empty: held back until it is whole or clear of a stop string) and the
    finish reason once the sequence has ended."""

    token: int | None
    text: str
    finish: FinishReason | None


class SequenceState:
    """One sequence's state between steps: its sampler (with the grammar matcher, if any),
    detokenizer and stop buffer (the ids whose text is not handed out yet), the tokens it
    has seen (for the repetition penalty) and its timings.

    ``step`` turns one position's logits into a token and says whether the sequence ended;
    whoever holds the backend (``run``) prefills, decodes and keeps the KV cache. The state
    is one object per sequence, so a loop over many sequences steps each the same way.
    """

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], sampler: Sampler) -> None:
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.prompt_tokens = len(prompt)
        stop = sampler.config.stop if sampler.constraint is None else ()
        # Under a response_format the grammar decides where the reply ends: a stop string
        # would cut it mid-value and call that "stop", so stop strings do not apply.
        self.detok = IncrementalDetokenizer(tokenizer.token_bytes, stop)
        self.context: list[int] = list(prompt)  # for the repetition penalty
        self.generated: list[int] = []
        self.unsent: list[int] = []  # ids whose text has not been handed out yet
        self.unsent_logprobs: list[TokenLogprob] = []  # theirs, with top_logprobs set
        self.reused = 0  # prompt tokens found in the KV cache
        self.disk = 0  # of which read from the prompt cache on disk
        self.t_start = self.t_first = self.t_last = 0.0  # perf_counter seconds
        self.drafted = self.accepted = 0  # speculative decoding: tokens drafted, and kept

    def step(self, logits: np.ndarray, *, cancelled: bool, out_of_room: bool) -> _Step:
        """Sample the next token from ``logits`` (the last position's) and take it in.

        ``out_of_room``: the cache has no room after this token and nothing slides it.
        """
        if cancelled:
            return _Step(None, "", "cancelled")
        constraint = self.sampler.constraint
        raw = logits  # the model's own, for top_logprobs
        if constraint is not None:
            if constraint.complete:  # the grammar has ended: nothing may follow
                return _Step(None, "", "stop")
            # raises InvalidRequestError (the stream ends with it, never with a finish that
            # looks clean) when the engine meets one of its limits, nothing can follow, or
            # logit_bias bans every allowed token
            logits = constraint.mask(logits)
        token = self.sampler(logits, self.context, self.generated)
        self.t_last = time.perf_counter()
        if self.tokenizer.is_end_of_generation(token):
            return _Step(None, "", "stop")
        if constraint is not None:
            constraint.accept(token)  # raises, as mask() does, rather than hand out a bad token
        self.generated.append(token)
        self.context.append(token)
        self.unsent.append(token)
        if self.sampler.config.top_logprobs is not None:
            top = self.sampler.config.top_logprobs
            self.unsent_logprobs.append(token_logprob(raw, token, top))
        text = self.detok.push(token)
        if self.detok.stopped or (constraint is not None and constraint.complete):
            return _Step(token, text, "stop")
        if len(self.generated) >= self.sampler.config.max_new_tokens or out_of_room:
            if constraint is not None:
                logger.warning(
                    "the reply ended after %d tokens (max_new_tokens or the context) before "
                    "its response_format was complete: its text does not match the format; "
                    "raise max_new_tokens",
                    len(self.generated),
                )
            return _Step(token, text, "length")
        return _Step(token, text, None)

    def chunk(self, text: str) -> Chunk:
        """Hand out ``text`` with the ids not handed out yet."""
        chunk = Chunk(text, tuple(self.unsent), logprobs=tuple(self.unsent_logprobs))
        self.unsent.clear()
        self.unsent_logprobs.clear()
        return chunk

    def last_chunk(self, text: str, finish: FinishReason) -> Chunk:
        """The stream's last chunk: the rest of the text, the finish reason and the stats."""
        tail = text + self.detok.finish()
        n = len(self.generated)
        prefill_s = self.t_first - self.t_start
        decode_s = self.t_last - self.t_first
        stats = GenerationStats(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=n,
            reused_prompt_tokens=self.reused,
            ttft_s=prefill_s,
            prefill_tokens_per_s=(self.prompt_tokens - self.reused) / max(prefill_s, 1e-9),
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            total_s=time.perf_counter() - self.t_start,
            peak_rss_bytes=peak_rss(),
            disk_prompt_tokens=self.disk,
            draft_tokens=self.drafted,
            accepted_tokens=self.accepted,
        )
        return Chunk(tail, tuple(self.unsent), finish, stats, logprobs=tuple(self.unsent_logprobs))
