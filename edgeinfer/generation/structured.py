"""Structured output: the tokens a grammar allows, applied to the logits before sampling.

``response_format`` takes OpenAI's shapes and three more:

- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- ``{"type": "regex", "pattern": "..."}``;
- ``{"type": "choice", "choices": ["a", "b"]}``: exactly one of the strings;
- ``{"type": "grammar", "lark": "..."}``: a Lark grammar (llguidance's dialect);
- ``{"type": "text"}`` or None: no constraint.

JSON output (``json_object``, ``json_schema``) is written on one line by default: one space
after each ``:`` and ``,`` and no other whitespace (``{"a": 1, "b": [1, 2]}``, what
``json.dumps`` writes), so a sampled reply cannot spend its tokens on blank indented lines;
``"whitespace": "free"`` in the response_format allows JSON's whitespace between tokens.
Under ``json_schema`` an object schema that names ``properties`` and says nothing of
``additionalProperties`` allows only the properties it names (OpenAI's structured-output
convention; ``additionalProperties: true`` or a schema allows others); ``"schema_semantics":
"json-schema"`` in the response_format keeps plain JSON Schema's meaning instead (unnamed
properties allowed).

The grammar engine is llguidance (the ``structured`` extra), imported only when a request
asks for a format. One implementation serves every backend: edgeinfer samples in its own
loop, so the mask is applied there.

llguidance is native code: a structure deep or long enough overflows its stack (a
segmentation fault, measured: a chain of ~3,000 ``$ref`` or Lark rules on an 8 MiB stack, 300
on 1 MiB), and a repetition count large enough meets its own limits only once generation has
started. So every format is bounded before it is compiled, one function per kind
(:func:`check_schema`, :func:`check_regex`, :func:`check_grammar`, :func:`check_choices`, in
structured_bounds.py, with the measured limits), the compile runs on a thread of its own with
a large stack, and the first steps of the grammar are
tried before the request is accepted: every failure is an ``InvalidRequestError`` before any
token.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ..errors import BackendUnavailableError, InvalidRequestError
from .structured_bounds import check_choices, check_grammar, check_regex, check_schema

__all__ = [
    "Constraint",
    "check_choices",
    "check_grammar",
    "check_regex",
    "check_response_format",
    "check_schema",
    "compile_constraint",
    "named_properties_only",
]

_COMPILE_STACK_BYTES = 256 * 2**20  # reserved address space; only what is touched is used
_stack_lock = threading.Lock()
_T = TypeVar("_T")

_JSON_KINDS = frozenset({"json_object", "json_schema"})
_KINDS = ("text", "json_object", "json_schema", "regex", "choice", "grammar")
_WHITESPACE = ("compact", "free")
_SEMANTICS = ("openai", "json-schema")
# llguidance's JSON options for the whitespace setting (applied before the schema's own
# "x-guidance", which overrides them)
_JSON_OPTIONS: dict[str, dict[str, Any]] = {
    "compact": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "free": {"whitespace_flexible": True},
}
# schema keywords whose value is a schema, a list of schemas or a map of name -> schema
_ONE_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def check_response_format(value: Any) -> dict[str, Any] | None:
    """``value`` as a checked response_format (a plain dict), or None for plain text; its
    schema, pattern, grammar or choices bounded by the kind's check."""
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
    _check_json_options(value)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                "{...}}} with the schema as an object"
            )
        check_schema(schema)
    elif kind == "regex":
        check_regex(value.get("pattern"))
    elif kind == "choice":
        check_choices(value.get("choices"))
    elif kind == "grammar":
        check_grammar(value.get("lark"))
    return dict(value)


def _check_json_options(value: dict[str, Any]) -> None:
    for key, allowed in (("whitespace", _WHITESPACE), ("schema_semantics", _SEMANTICS)):
        if key in value and value[key] not in allowed:
            raise InvalidRequestError(
                f"response_format {key}={_short(value[key])} is invalid: expected one of "
                f"{', '.join(allowed)}"
            )


def named_properties_only(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` where every object schema that names ``properties`` and says
    nothing of ``additionalProperties`` gets ``additionalProperties: false`` (OpenAI's
    convention). Walks only the keywords that hold schemas, so a property that happens to be
    called "properties" is not taken for the keyword; iterative (the schema is bounded by
    check_schema first)."""
    root = json.loads(json.dumps(schema))  # a deep copy, plain JSON
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in _ONE_SCHEMA:
            stack.append(node.get(key))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return root  # type: ignore[no-any-return]


def _grammar(fmt: dict[str, Any], llg: Any) -> str:
    kind = fmt["type"]
    matcher = llg.LLMatcher
    options = _JSON_OPTIONS[fmt.get("whitespace", "compact")]
    try:
        if kind == "json_object":
            return str(matcher.grammar_from_json_schema({"type": "object"}, defaults=options))
        if kind == "json_schema":
            schema = fmt["json_schema"]["schema"]
            if fmt.get("schema_semantics", "openai") == "openai":
                schema = named_properties_only(schema)
            # ASCII: llguidance cuts schema excerpts in its messages at a byte count, and
            # panics when the cut falls inside a multi-byte character
            text = json.dumps(schema, ensure_ascii=True)
            return str(matcher.grammar_from_json_schema(text, defaults=options))
        if kind == "regex":
            return str(matcher.grammar_from_regex(fmt["pattern"]))
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in fmt["choices"])
            return str(matcher.grammar_from_lark(f"start: {alternatives}"))
        return str(matcher.grammar_from_lark(fmt["lark"]))
    except (ValueError, TypeError) as exc:  # UnicodeError is a ValueError
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
        self._banned: np.ndarray | None = None
        self.is_json = is_json
        self.steps = 0  # tokens accepted so far

    def ban(self, token_ids: list[int]) -> None:
        """Tokens logit_bias bans (-inf): a step whose every allowed token is among them is
        refused by allowed() instead of sampling from an all -inf row."""
        self._banned = np.asarray(sorted(token_ids), dtype=np.int64) if token_ids else None

    def allowed(self) -> np.ndarray:
        """The mask for the next token (bool [n_vocab]); InvalidRequestError when the engine
        failed (one of its limits), no token can continue the grammar, or logit_bias bans
        every token it allows."""
        bits = self._bits
        _engine_errors(lambda: self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes))
        self._raise_if_error()
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._n)
        allowed = allowed.astype(bool)
        if not allowed.any():
            raise self._nothing()
        if self._banned is not None:
            allowed[self._banned[self._banned < self._n]] = False
            if not allowed.any():
                raise InvalidRequestError(
                    f"logit_bias bans (-inf) every token response_format allows{self._where()}; "
                    "unban some of them or change the format"
                )
        return allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every disallowed token at -inf (a copy); errors as allowed()."""
        allowed = self.allowed()
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        keep = np.flatnonzero(allowed[: logits.shape[0]])
        out[keep] = logits[keep]
        return out

    def accept(self, token: int) -> None:
        """Advance past ``token``; InvalidRequestError when the engine cannot take it."""
        if not _engine_errors(lambda: self._matcher.consume_token(token), self._where()):
            self._raise_if_error()
            raise InvalidRequestError(
                f"response_format: the grammar engine refused token {token}{self._where()}"
            )
        self.steps += 1

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (llguidance's fast-forward: the
        canonical tokens of the only bytes that can follow); [] when it is not sure."""
        if limit <= 0 or self.complete:
            return []
        tokens = _engine_errors(self._matcher.compute_ff_tokens)
        if self._matcher.is_error() or not isinstance(tokens, list):
            return []
        return [int(t) for t in tokens[:limit] if 0 <= int(t) < self._n]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the start, the grammar takes from its state now
        (it does not move): a draft is cut there, a token it refuses never being picked."""
        if not tokens or self.complete or any(not 0 <= t < self._n for t in tokens):
            return 0
        try:
            count = _engine_errors(lambda: self._matcher.validate_tokens(tokens))
        except InvalidRequestError:  # the engine failed here: draft nothing, decode plainly
            return 0
        return count if isinstance(count, int) and 0 <= count <= len(tokens) else 0

    def _raise_if_error(self) -> None:
        if not self._matcher.is_error():
            return
        if self._matcher.get_error().startswith("NoExtensionBias"):  # no byte can follow
            raise self._nothing()
        raise InvalidRequestError(
            f"response_format: the grammar engine stopped{self._where()}: "
            f"{_first_line(self._matcher.get_error())}; simplify the format (fewer "
            "alternatives, smaller repetition counts)"
        )

    def _nothing(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"response_format can match nothing{self._where()}: no text (no token of the "
            "model's vocabulary) continues it; check that the format can be satisfied"
        )

    def _where(self) -> str:
        return f" after {self.steps} generated tokens" if self.steps else ""

    def probe(self) -> None:
        """Try the grammar's first step and, on a copy, the one after the first allowed
        token: a format that matches nothing or meets an engine limit there is refused
        before any token, not mid-reply."""
        allowed = np.flatnonzero(self.allowed())
        ahead = Constraint(self._matcher.deep_copy(), self._n, self.is_json)
        ahead.accept(int(allowed[0]))
        if not ahead.complete:
            ahead.allowed()
        ahead.steps = 0

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
    a schema, pattern or grammar it cannot compile or whose first steps fail.

    ``fmt`` is checked again (check_response_format is idempotent and cheap), so a dict
    changed after SamplingConfig checked it is bounded too."""
    checked = check_response_format(fmt)
    if checked is None:
        raise InvalidRequestError("response_format text has no grammar to compile")
    llg = _import()
    return _on_large_stack(lambda: _engine_errors(lambda: _compile(checked, tokenizer, llg)))


def _engine_errors(work: Callable[[], _T], where: str = "") -> _T:
    """``work()``, with a panic inside llguidance (pyo3's PanicException, a BaseException,
    e.g. on some malformed schemas) refused as an InvalidRequestError."""
    try:
        return work()
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise InvalidRequestError(
            f"response_format: the grammar engine failed on this format{where} "
            f"({_first_line(str(exc))}); check the format against its kind's rules"
        ) from exc


def _compile(fmt: dict[str, Any], tokenizer: Any, llg: Any) -> Constraint:
    grammar = _grammar(fmt, llg)
    lltok = _lltokenizer(tokenizer, llg)
    limits = llg.LLParserLimits(verbose_errors=False)  # errors without the parser's state
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok, limits=limits)
    if is_error:
        raise InvalidRequestError(
            f"response_format is invalid: {_first_line(messages[0] if messages else '')}"
        )
    matcher = llg.LLMatcher(lltok, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise InvalidRequestError(f"response_format is invalid: {_first_line(matcher.get_error())}")
    constraint = Constraint(matcher, tokenizer.n_vocab, fmt["type"] in _JSON_KINDS)
    constraint.probe()
    return constraint


def _on_large_stack(work: Callable[[], _T]) -> _T:
    """``work()`` run on a fresh thread with a _COMPILE_STACK_BYTES stack: the compiler
    recurses over the grammar, and the caller's thread may have a small stack (2 MiB where
    the stack limit is unlimited, less on some platforms)."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # handed to the caller's thread as it is
            outcome.append((False, exc))

    with _stack_lock:  # stack_size() is process-wide: set, start, restore
        try:
            previous = threading.stack_size(_COMPILE_STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform that cannot set it: run here
            return work()
        try:
            thread = threading.Thread(target=target, name="edgeinfer-grammar", daemon=True)
            thread.start()
        except RuntimeError:  # no room for such a stack (a 32-bit process): the bounds hold
            thread = None
        finally:
            threading.stack_size(previous)
    if thread is None:
        return work()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _first_line(text: str) -> str:
    """The engine's message on one line (its regex errors span several), cut to 300
    characters."""
    line = " ".join(text.replace("<non-verbose/>", "").split()) or "no reason given"
    return line if len(line) <= 300 else line[:297] + "..."


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
