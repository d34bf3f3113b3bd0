"""Sampling: one frozen, validated SamplingConfig, and a sampler built from it per request.

The sampler works on the last position's logits (float32, shape [vocab]) with numpy only; no
Python loop touches the vocabulary. Order of the transforms: logit bias, repetition penalty,
frequency and presence penalties, temperature, top-k, top-p, min-p, then a draw from what is
left. ``temperature=0`` is greedy
(argmax after bias and penalty).

Defined edge cases: a temperature so small that it underflows float32 (below ~1.2e-38) samples
as if it were that smallest normal float32 (effectively greedy); biases are bounded by
``MAX_LOGIT_BIAS`` and ``-inf`` bans a token; a ``logit_bias`` banning every token is refused;
logits that are NaN or infinite at the chosen token raise ``BackendUnavailableError`` instead of
handing out a meaningless token. A repetition penalty below float32's smallest normal number
acts as that number, and penalised logits are kept within float32's finite range.

``frequency_penalty`` and ``presence_penalty`` have OpenAI's meaning: a token the reply has
already generated ``c`` times has ``c * frequency_penalty + (c > 0) * presence_penalty``
subtracted from its logit, counting every token generated so far in this sequence (not the
prompt). llama.cpp's sampler subtracts the same amounts, counted over its last
``penalty_last_n`` (64) tokens; OpenAI counts the whole reply, and so does edgeinfer. Both
lie in OpenAI's range [-2, 2]; negative values favour repetition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, InvalidRequestError, short_repr
from .speculative import SpeculativeConfig, parse_speculative

__all__ = ["MAX_LOGIT_BIAS", "Sampler", "SamplingConfig"]

MAX_LOGIT_BIAS = 1e6  # |bias| above this is refused (float32 logits + bias would overflow)
# Temperatures and repetition penalties are applied in float32: smaller ones are raised to its
# smallest normal number, larger penalties lowered to its largest.
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_FLOAT32_MAX = float(np.finfo(np.float32).max)

_MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's range)

# The first candidate set tried for top-p; grown 4x until it holds the nucleus.
_TOP_P_FIRST_GUESS = 64


def is_int(value: object) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _bad(name: str, value: object, expected: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name}={short_repr(value)} is invalid: expected {expected}")


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick each next token. Build with keywords; every field is validated."""

    max_new_tokens: int = 256
    temperature: float = 0.8
    top_k: int | None = 40
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    # structured output (see edgeinfer.generation.structured): JSON, a JSON schema, a regex,
    # a choice or a Lark grammar; None is plain text
    response_format: dict[str, Any] | None = field(default=None, hash=False)
    # speculative decoding for this request ("off", "auto", "lookup", "lookup:N", or the
    # "draft:NAME" the model was loaded with; see
    # edgeinfer.generation.speculative); None: the model's setting from load(speculative=...). It
    # changes how fast tokens come, never which tokens the sampler picks.
    speculative: SpeculativeConfig | str | None = None
    # log-probabilities of the generated tokens (GenerationResult.logprobs): None = off; N =
    # each token's own and the N likeliest at its place (0..20, OpenAI's top_logprobs)
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        from .structured import check_response_format

        if self.speculative is not None:
            object.__setattr__(self, "speculative", parse_speculative(self.speculative))
        object.__setattr__(self, "response_format", check_response_format(self.response_format))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate_numbers()
        self._validate_collections()

    def _validate_numbers(self) -> None:
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise _bad("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 0):
            raise _bad("top_k", self.top_k, "None, 0 (off) or an integer >= 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1]; 1 turns it off")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            raise _bad("min_p", self.min_p, "a number in [0, 1); 0 turns it off")
        penalty = self.repetition_penalty
        if not _is_number(penalty) or not 0 < penalty < math.inf:
            raise _bad("repetition_penalty", penalty, "a finite number > 0; 1 turns it off")
        if not is_int(self.repetition_window) or self.repetition_window < 0:
            raise _bad("repetition_window", self.repetition_window, "an integer >= 0")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -_MAX_PENALTY <= value <= _MAX_PENALTY:
                raise _bad(name, value, "a number from -2 to 2 (OpenAI's range); 0 turns it off")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise _bad("seed", self.seed, "None or an integer in [0, 2**64)")
        top = self.top_logprobs
        if top is not None and (not is_int(top) or not 0 <= top <= _MAX_TOP_LOGPROBS):
            raise _bad(
                "top_logprobs", top, f"None (off) or an integer from 0 to {_MAX_TOP_LOGPROBS}"
            )

    def _validate_collections(self) -> None:
        stops = self.stop
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop", stops, "a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stops))

    @classmethod
    def from_kwargs(cls, base: SamplingConfig | None = None, **kwargs: Any) -> SamplingConfig:
        """``base`` (or the defaults) with the given fields replaced; unknown names rejected."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling argument(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return replace(base or cls(), **kwargs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_MAX_TOP_LOGPROBS = 20  # OpenAI's bound (edgeinfer.generation.scoring.MAX_TOP_LOGPROBS)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (id, bias) pairs, from a mapping or a sequence of pairs."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items: list[Any] = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise _bad("logit_bias", value, "a mapping token id -> bias")
    expected = f"token ids >= 0 mapped to biases within +-{MAX_LOGIT_BIAS:g}, or -inf to ban"
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise _bad("logit_bias", value, expected)
        token, bias = item
        if not is_int(token) or token < 0 or not _is_number(bias):
            raise _bad("logit_bias", value, expected)
        bias = float(bias)
        if not (abs(bias) <= MAX_LOGIT_BIAS or bias == -math.inf):
            raise _bad("logit_bias", value, expected)
        pairs[int(token)] = bias
    return tuple(sorted(pairs.items()))


def _top_k(x: np.ndarray, k: int, peak: np.floating) -> np.ndarray:
    """Ids of the k largest logits (exact). Logits are first narrowed to those within 10 of
    the maximum, a few hundred in practice, so the selection does not scan the vocabulary
    twice; if fewer than k are that close, the whole vocabulary is searched."""
    near = np.flatnonzero(x >= peak - np.float32(10.0))
    if near.size == k:
        return near
    if near.size > k:
        return near[np.argpartition(x[near], near.size - k)[near.size - k :]]
    return np.argpartition(x, x.size - k)[x.size - k :]


def _finite_choice(x: np.ndarray, token: int) -> int:
    """``token`` if its logit is a finite number, else an error (NaN/inf from the engine)."""
    value = x[token]
    if np.isfinite(value):
        return token
    raise BackendUnavailableError(
        f"no token has a finite logit (the best is {float(value)}, token {token}): the "
        "model's weights are damaged or the engine failed; re-download or re-convert the model"
    )


class Sampler:
    """Picks the next token from one position's logits; one instance per request."""

    def __init__(self, config: SamplingConfig, vocab_size: int) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self._bias_ids = np.array([i for i, _ in config.logit_bias], dtype=np.int64)
        self._bias_values = np.array([b for _, b in config.logit_bias], dtype=np.float32)
        if self._bias_ids.size and int(self._bias_ids.max()) >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token id {int(self._bias_ids.max())}, but the vocabulary "
                f"has {vocab_size} tokens (ids 0..{vocab_size - 1})"
            )
        banned = {i for i, b in config.logit_bias if b == -math.inf}
        if len(banned) >= vocab_size:
            raise InvalidRequestError(
                "logit_bias bans every token of the vocabulary (-inf for all ids); leave at "
                "least one token allowed"
            )
        self._counts_penalty = config.frequency_penalty != 0 or config.presence_penalty != 0
        self._needs_copy = (
            bool(self._bias_ids.size) or config.repetition_penalty != 1.0 or self._counts_penalty
        )
        self._counts: dict[int, int] = {}  # generated token id -> times generated
        self._counted = 0  # how many of the generated tokens _counts holds
        self.constraint: Any = None  # a structured.Constraint when response_format is set
        self._temperature = np.float32(max(config.temperature, _FLOAT32_TINY))

    def __call__(
        self, logits: np.ndarray, history: Sequence[int] = (), generated: Sequence[int] = ()
    ) -> int:
        """logits: float32 [vocab] (may be an engine-owned view; it is never written);
        ``history``: the sequence's tokens (prompt and reply, for the repetition penalty);
        ``generated``: the reply's tokens so far (for the frequency and presence penalties)."""
        cfg = self.config
        if not self._needs_copy:
            if cfg.greedy:
                return _finite_choice(logits, int(np.argmax(logits)))
            x = logits.astype(np.float32)  # a copy: the engine's buffer stays untouched
        else:
            x = np.array(logits, dtype=np.float32)
            self._apply_bias_and_penalty(x, history)
            if self._counts_penalty:
                self._apply_counts(x, generated)
            if cfg.greedy:
                return _finite_choice(x, int(np.argmax(x)))
        peak = x.max()
        if not np.isfinite(peak):  # NaN anywhere, or +inf
            _finite_choice(x, int(np.argmax(x)))
        # shifted before scaling: (x - peak) / T is <= 0, so a tiny T cannot overflow to NaN
        x -= peak
        with np.errstate(over="ignore"):  # far-below-peak logits become -inf: probability 0
            x /= self._temperature
        ids, probs = self._filter(x)
        return int(ids[self._draw(probs)])

    def _apply_bias_and_penalty(self, x: np.ndarray, history: Sequence[int]) -> None:
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias_values
        cfg = self.config
        if cfg.repetition_penalty != 1.0 and cfg.repetition_window and len(history):
            recent = np.unique(np.asarray(history[-cfg.repetition_window :], dtype=np.int64))
            recent = recent[(recent >= 0) & (recent < x.size)]
            values = x[recent]
            # a penalty that underflows float32 acts as its smallest normal number, and the
            # penalised logits stay finite (a tiny penalty would divide them past float32)
            penalty = np.float32(min(max(cfg.repetition_penalty, _FLOAT32_TINY), _FLOAT32_MAX))
            with np.errstate(over="ignore"):
                penalised = np.where(values > 0, values / penalty, values * penalty)
            x[recent] = np.clip(penalised, -_FLOAT32_MAX, _FLOAT32_MAX)

    def _apply_counts(self, x: np.ndarray, generated: Sequence[int]) -> None:
        """OpenAI's frequency and presence penalties over the reply's tokens so far; the
        counts grow with the reply, so each step only counts the tokens added since the last."""
        if len(generated) < self._counted:  # another sequence: count it afresh
            self._counts.clear()
            self._counted = 0
        counts = self._counts
        for token in generated[self._counted :]:
            counts[int(token)] = counts.get(int(token), 0) + 1
        self._counted = len(generated)
        if not counts:
            return
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        times = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        inside = (ids >= 0) & (ids < x.size)
        ids, times = ids[inside], times[inside]
        cfg = self.config
        penalty = times * np.float32(cfg.frequency_penalty) + np.float32(cfg.presence_penalty)
        with np.errstate(over="ignore", invalid="ignore"):
            penalised = x[ids] - penalty
        # -inf (banned) stays -inf; finite logits stay within float32's finite range
        x[ids] = np.where(
            np.isneginf(x[ids]), x[ids], np.clip(penalised, -_FLOAT32_MAX, _FLOAT32_MAX)
        )

    def _filter(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Candidate ids and their (unnormalised) probabilities after top-k/top-p/min-p."""
        cfg = self.config
        vocab = x.size
        k = vocab if not cfg.top_k else min(cfg.top_k, vocab)
        peak = x.max()
        if k < vocab:
            # only the top k are ever candidates: work on them alone
            ids = _top_k(x, k, peak)
            ids = ids[np.argsort(-x[ids], kind="stable")]
            probs = np.exp(x[ids] - peak)
            if cfg.top_p < 1.0:
                cum = np.cumsum(probs, dtype=np.float64)
                n = int(np.searchsorted(cum, cfg.top_p * cum[-1])) + 1
                ids, probs = ids[:n], probs[:n]
        else:
            p = np.exp(x - peak)  # [vocab], unnormalised
            ids = np.arange(vocab) if cfg.top_p >= 1.0 else self._nucleus(x, p)
            probs = p[ids]
        if cfg.min_p > 0:
            keep = probs >= np.float32(cfg.min_p) * probs.max()
            ids, probs = ids[keep], probs[keep]
        return ids, probs

    def _nucleus(self, x: np.ndarray, p: np.ndarray) -> np.ndarray:
        """Top-p over the whole vocabulary: the smallest prefix (by probability) holding
        top_p of the mass, found by sorting a growing top slice instead of everything."""
        vocab = x.size
        target = self.config.top_p * p.sum(dtype=np.float64)
        near = np.flatnonzero(x >= x.max() - np.float32(10.0))  # usually holds the nucleus
        near = near[np.argsort(-x[near], kind="stable")]
        cum = np.cumsum(p[near], dtype=np.float64)
        if cum[-1] >= target:  # every id left out is less likely than every id in `near`
            return near[: int(np.searchsorted(cum, target)) + 1]
        m = min(_TOP_P_FIRST_GUESS, vocab)
        while True:
            top = np.argpartition(x, vocab - m)[vocab - m :] if m < vocab else np.arange(vocab)
            top = top[np.argsort(-x[top], kind="stable")]
            cum = np.cumsum(p[top], dtype=np.float64)
            if cum[-1] >= target or m == vocab:
                return top[: int(np.searchsorted(cum, target)) + 1]
            m = min(m * 4, vocab)

    def _draw(self, probs: np.ndarray) -> int:
        cum = np.cumsum(probs, dtype=np.float64)
        pick = int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
        return min(pick, len(cum) - 1)
