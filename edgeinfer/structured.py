"""Structured output: the tokens a grammar allows, applied to the logits before sampling.

``response_format`` takes OpenAI's shapes and three more:

- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- ``{"type": "regex", "pattern": "..."}``;
- ``{"type": "choice", "choices": ["a", "b"]}``: exactly one of the strings;
- ``{"type": "grammar", "lark": "..."}``: a Lark grammar (llguidance's dialect);
- ``{"type": "text"}`` or None: no constraint.

The grammar engine is llguidance (the ``structured`` extra), imported only when a request
asks for a format. One implementation serves every backend: edgeinfer samples in its own
loop, so the mask is applied there.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from .errors import BackendUnavailableError, InvalidRequestError

__all__ = ["Constraint", "check_response_format", "compile_constraint"]

_JSON_KINDS = frozenset({"json_object", "json_schema"})
_KINDS = ("text", "json_object", "json_schema", "regex", "choice", "grammar")
_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def check_response_format(value: Any) -> dict[str, Any] | None:
    """``value`` as a checked response_format (a plain dict), or None for plain text."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in _KINDS:
        raise InvalidRequestError(
            f"response_format={_short(value)} is invalid: expected an object whose type is one "
            f"of {', '.join(_KINDS)}"
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                "{...}}} with the schema as an object"
            )
    elif kind == "regex" and not (isinstance(value.get("pattern"), str) and value["pattern"]):
        raise InvalidRequestError("response_format regex needs a non-empty string pattern")
    elif kind == "choice":
        choices = value.get("choices")
        if not (
            isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)
        ):
            raise InvalidRequestError(
                "response_format choice needs choices: a non-empty list of non-empty strings"
            )
    elif kind == "grammar" and not (isinstance(value.get("lark"), str) and value["lark"]):
        raise InvalidRequestError("response_format grammar needs a non-empty Lark grammar (lark)")
    return dict(value)


def _grammar(fmt: dict[str, Any], llg: Any) -> str:
    kind = fmt["type"]
    matcher = llg.LLMatcher
    try:
        if kind == "json_object":
            return str(matcher.grammar_from_json_schema({"type": "object"}))
        if kind == "json_schema":
            return str(matcher.grammar_from_json_schema(fmt["json_schema"]["schema"]))
        if kind == "regex":
            return str(matcher.grammar_from_regex(fmt["pattern"]))
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in fmt["choices"])
            return str(matcher.grammar_from_lark(f"start: {alternatives}"))
        return str(matcher.grammar_from_lark(fmt["lark"]))
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"response_format: {exc}") from exc


def _import() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise BackendUnavailableError(
            "response_format needs the structured-output extra: pip install 'edgeinfer[structured]'"
        ) from exc
    return llguidance


class _Vocabulary:
    """The model's tokenizer as llguidance's ``TokenizerWrapper`` expects it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        n = tokenizer.n_vocab
        ends = [i for i in range(n) if tokenizer.is_end_of_generation(i)]
        self.eos_token_id = ends[0] if ends else n - 1
        self.eos_ids = ends or [n - 1]
        self.bos_token_id = None
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(n):
            piece = tokenizer.token_bytes(i)
            if not piece:  # special tokens have no text: marked so no grammar matches them
                piece = b"\xff<special_%d>" % i
                special.append(i)
            tokens.append(piece)
        self.tokens = tokens
        self.special_token_ids = special

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special=False, parse_special=False))


def _lltokenizer(tokenizer: Any, llg: Any) -> Any:
    with _tokenizers_lock:
        cached = _tokenizers.get(tokenizer)
        if cached is None:
            vocab = _Vocabulary(tokenizer)
            cached = llg.LLTokenizer(
                llg.TokenizerWrapper(vocab), n_vocab=len(vocab.tokens), eos_token=vocab.eos_ids
            )
            _tokenizers[tokenizer] = cached
        return cached


class Constraint:
    """One request's grammar state: the allowed-token mask before each sample, the sampled
    token after it."""

    def __init__(self, matcher: Any, n_vocab: int, is_json: bool) -> None:
        self._matcher = matcher
        self._n = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self.is_json = is_json

    def mask(self, logits: np.ndarray) -> np.ndarray | None:
        """The logits with every disallowed token at -inf (a copy), or None when the grammar
        allows no token at all."""
        if self._matcher.is_error():
            return None
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._n)
        if not allowed.any():
            return None
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        keep = np.flatnonzero(allowed)
        keep = keep[keep < logits.shape[0]]
        out[keep] = logits[keep]
        return out

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar cannot take it."""
        return bool(self._matcher.consume_token(token))

    @property
    def complete(self) -> bool:
        """The grammar has ended: nothing more can follow."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())

    def parse(self, text: str, finish_reason: str) -> Any:
        """The parsed JSON of a complete reply; None for other formats or an incomplete one."""
        if not self.is_json or finish_reason != "stop" or not self.accepting:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return None


def compile_constraint(fmt: dict[str, Any], tokenizer: Any) -> Constraint:
    """A fresh Constraint for one request; InvalidRequestError with the engine's reason for
    a schema, pattern or grammar it cannot compile."""
    llg = _import()
    grammar = _grammar(fmt, llg)
    lltok = _lltokenizer(tokenizer, llg)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        raise InvalidRequestError(f"response_format is invalid: {messages[0] if messages else ''}")
    matcher = llg.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"response_format is invalid: {matcher.get_error()}")
    return Constraint(matcher, tokenizer.n_vocab, fmt["type"] in _JSON_KINDS)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
