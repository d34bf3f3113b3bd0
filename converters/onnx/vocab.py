"""A GGUF file's vocabulary as a ``tokenizer.json`` that gives llama.cpp's ids.

The GGUF carries everything a tokenizer needs: the token strings, their types (normal,
control, user-defined, byte), the merges of a byte-level BPE vocabulary or the scores of a
SentencePiece one, and the special ids. This module turns them into the Hugging Face
``tokenizers`` format the ONNX backend loads, following llama.cpp's rules:

- byte-level BPE (``tokenizer.ggml.model = gpt2``): llama.cpp's pre-tokenizer regexes for the
  file's ``tokenizer.ggml.pre``, applied one after another (``Split`` steps, matches kept),
  then the byte-to-unicode mapping and the merges;
- SentencePiece (``llama``): spaces become U+2581, a leading one is added when
  ``add_space_prefix`` says so, pieces merge by score (merges ranked by the merged piece's
  score) and anything left over falls back to ``<0xXX>`` byte tokens.

Control tokens become special added tokens (matched in prompts, never shown as text);
user-defined ones become plain added tokens. ``validate.check_against_llama_cpp`` compares
the ids with llama.cpp on the source file when llama-cpp-python is installed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError
from edgeinfer.files.gguf_checks import check_gguf_model
from edgeinfer.files.gguf_eog import end_of_generation_ids
from edgeinfer.files.gguf_file import read_gguf_header

__all__ = [
    "GGUFVocabulary",
    "checked_tokenizer_json",
    "read_gguf_vocabulary",
    "tokenizer_json",
    "write_tokenizer_files",
]

logger = logging.getLogger(__name__)


_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPM_SPACE = "\u2581"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's regex steps per tokenizer.ggml.pre (llama-vocab.cpp); "default" is GPT-2's
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt-2": (_GPT2,),
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    "jais": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "command-r": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "exaone": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "stablelm2": (_QWEN2,),
}
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3"})  # whole words in the vocabulary win
_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
)


@dataclass(frozen=True)
class GGUFVocabulary:
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: list[float]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: tuple[int, ...]
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        return self.tokens[token_id] if token_id is not None else None

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "pre": self.pre,
            "tokens": len(self.tokens),
            "merges": len(self.merges),
            "add_bos": self.add_bos,
            "eog_ids": list(self.eog_ids),
        }


def read_gguf_vocabulary(path: str | Path) -> GGUFVocabulary:
    """The vocabulary of the GGUF file at ``path``; ConversionError when it is missing or of a
    kind this module cannot write (only byte-level BPE and SentencePiece are)."""
    header = read_gguf_header(path, whole_arrays=_ARRAYS)
    meta = header.metadata
    name = Path(path).name
    facts = header.token_facts
    if facts is not None and facts.not_utf8 is not None:  # tokenizer.json holds text only
        raise ConversionError(
            f"{name}: tokenizer.ggml.tokens[{facts.not_utf8}] is not UTF-8 text, which "
            "tokenizer.json cannot hold; the native builder cannot write this vocabulary"
        )
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ConversionError(
            f"{name}: tokenizer model {model!r} cannot be written as tokenizer.json (byte-level "
            "BPE 'gpt2' and SentencePiece 'llama' can); convert from the Hugging Face folder"
        )
    check_gguf_model(header, error=ConversionError)  # arrays typed and sized, merges "a b"
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConversionError(f"{name}: the file has no token list (tokenizer.ggml.tokens)")
    n = len(tokens)
    types = _array(meta, "tokenizer.ggml.token_type", n, name) or [_NORMAL] * n
    scores = _array(meta, "tokenizer.ggml.scores", n, name) or [0.0] * n
    merges = meta.get("tokenizer.ggml.merges") or []
    if model == "gpt2" and not merges:
        raise ConversionError(f"{name}: a BPE vocabulary without merges (tokenizer.ggml.merges)")
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if model == "gpt2" and pre not in _PRE_SPLITS:
        raise ConversionError(
            f"{name}: pre-tokenizer {pre!r} is not known to the native converter (known: "
            f"{', '.join(sorted(_PRE_SPLITS))}); convert with --builder optimum"
        )

    def special(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return int(value) if isinstance(value, int) and 0 <= value < n else None

    bos, eos = special("bos"), special("eos")
    texts = [str(t) for t in tokens]
    template = meta.get("tokenizer.chat_template")
    return GGUFVocabulary(
        model=model,
        pre=pre,
        tokens=texts,
        types=[int(t) for t in types],
        merges=[str(m) for m in merges],
        scores=[float(s) for s in scores],
        bos_id=bos,
        eos_id=eos,
        unk_id=special("unknown"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        eog_ids=end_of_generation_ids(meta, texts),  # llama.cpp's stop set, every token
        chat_template=template if isinstance(template, str) and template else None,
    )


def _array(meta: dict[str, Any], key: str, n: int, name: str) -> list[Any] | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        raise ConversionError(f"{name}: {key} does not have one entry per token ({n})")
    return value


def tokenizer_json(vocab: GGUFVocabulary) -> dict[str, Any]:
    """The ``tokenizer.json`` document for ``vocab``."""
    doc: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(vocab),
        "normalizer": None,
        "post_processor": _post_processor(vocab),
    }
    parts = _byte_level_bpe(vocab) if vocab.model == "gpt2" else _sentencepiece(vocab)
    return {**doc, **parts}


def _added_tokens(vocab: GGUFVocabulary) -> list[dict[str, Any]]:
    """Control tokens as special added tokens, user-defined ones as plain added tokens."""
    return [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == _CONTROL,
        }
        for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED) and t
    ]


def _byte_level_bpe(vocab: GGUFVocabulary) -> dict[str, Any]:
    """llama.cpp's regex splits for the file's ``pre``, then bytes as unicode, then merges."""
    steps = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in _PRE_SPLITS[vocab.pre]
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    model = _bpe(
        vocab.tokens,
        [m.split(" ", 1) for m in vocab.merges],
        byte_fallback=False,
        ignore_merges=vocab.pre in _IGNORE_MERGES,
        unk=None,
    )
    return {
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [*steps, {"type": "ByteLevel", **byte_level}],
        },
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": model,
    }


def _sentencepiece(vocab: GGUFVocabulary) -> dict[str, Any]:
    """Spaces as U+2581 (a leading one when ``add_space_prefix``), merges ranked by score,
    unknown bytes as ``<0xXX>`` tokens."""
    decoders = [
        {"type": "Replace", "pattern": {"String": _SPM_SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    model = _bpe(
        vocab.tokens,
        _merges_by_score(vocab),
        byte_fallback=True,
        ignore_merges=False,
        unk=vocab.token(vocab.unk_id),
    )
    return {
        "pre_tokenizer": {
            "type": "Metaspace",
            "replacement": _SPM_SPACE,
            "prepend_scheme": "first" if vocab.add_space_prefix else "never",
            "split": False,
        },
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }


def _bpe(
    tokens: list[str],
    merges: list[list[str]],
    *,
    byte_fallback: bool,
    ignore_merges: bool,
    unk: str | None,
) -> dict[str, Any]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated string keeps its first id, as llama.cpp does
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": byte_fallback,
        "byte_fallback": byte_fallback,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges,
    }


def _merges_by_score(vocab: GGUFVocabulary) -> list[list[str]]:
    """SentencePiece merges every adjacent pair whose union is a piece, best score first:
    as BPE merges, every split of every piece into two pieces, ranked by the piece's score."""
    ids = {}
    for i, t in enumerate(vocab.tokens):
        if vocab.types[i] in (_NORMAL, _USER_DEFINED, _UNUSED):
            ids.setdefault(t, i)
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[i], i, ids[left], left, right))
    ranked.sort()
    return [[left, right] for _, _, _, left, right in ranked]


def _post_processor(vocab: GGUFVocabulary) -> dict[str, Any] | None:
    first = [vocab.token(vocab.bos_id)] if vocab.add_bos and vocab.bos_id is not None else []
    last = [vocab.token(vocab.eos_id)] if vocab.add_eos and vocab.eos_id is not None else []
    if not first and not last:
        return None
    specials = {t: {"id": t, "ids": [vocab.tokens.index(t)], "tokens": [t]} for t in first + last}

    def seq(kind: str) -> list[dict[str, Any]]:
        return [
            *({"SpecialToken": {"id": t, "type_id": 0}} for t in first),
            {"Sequence": {"id": kind, "type_id": 0}},
            *({"SpecialToken": {"id": t, "type_id": 0}} for t in last),
        ]

    return {
        "type": "TemplateProcessing",
        "single": seq("A"),
        "pair": seq("A") + seq("B")[len(first) :],
        "special_tokens": specials,
    }


def checked_tokenizer_json(vocab: GGUFVocabulary, name: str) -> str:
    """``tokenizer.json``'s text for ``vocab``, once the tokenizers library has built a
    tokenizer from it: a vocabulary it refuses (merges of pieces that are not tokens, ...)
    is a ConversionError naming the file here, not a raw Exception at load."""
    text = json.dumps(tokenizer_json(vocab), ensure_ascii=False)
    try:
        from tokenizers import Tokenizer
    except ImportError:  # checked again when the folder is loaded
        return text
    try:
        Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises plain Exception
        raise ConversionError(
            f"{name}: its vocabulary cannot be written as tokenizer.json ({str(exc)[:200]}); "
            "the file is damaged or crafted"
        ) from exc
    return text


def write_tokenizer_files(vocab: GGUFVocabulary, folder: Path, document: str | None = None) -> None:
    """``tokenizer.json`` (``document``, or made from ``vocab``) and, when the file has one,
    ``chat_template.jinja`` in ``folder``."""
    text = (
        document if document is not None else json.dumps(tokenizer_json(vocab), ensure_ascii=False)
    )
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    if vocab.chat_template:
        (folder / "chat_template.jinja").write_text(vocab.chat_template, encoding="utf-8")
