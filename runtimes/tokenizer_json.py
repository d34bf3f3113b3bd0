"""A Tokenizer over a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

Token bytes are recovered from the vocabulary itself: byte-level BPE vocabularies spell each
byte with one printable character (the GPT-2 alphabet); SentencePiece-style vocabularies use
``▁`` for a space and ``<0xHH>`` for raw bytes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from edgeinfer.errors import BackendUnavailableError, ModelLoadError

from .base import TokenizerBase, is_marker, tokenizer_text

__all__ = ["JsonTokenizer"]

_SPM_SPACE = "\u2581"


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte: printable Latin-1 bytes stand for themselves, the rest are shifted
    to code points 256 and up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


def _mentions_byte_level(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(
            _mentions_byte_level(v) for v in node.values()
        )
    if isinstance(node, list):
        return any(_mentions_byte_level(v) for v in node)
    return False


class JsonTokenizer(TokenizerBase):
    def __init__(
        self,
        path: Path,
        *,
        eos_token_ids: Iterable[int],
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        n_vocab: int | None = None,
    ) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise BackendUnavailableError(
                "ONNX models need the tokenizers library: pip install 'edgeinfer[onnx]'"
            ) from exc
        try:
            # from_file, not a Python json.loads of the whole file: the vocabulary and merges
            # as Python objects cost ~50 MB of peak memory for a 49k-token vocabulary.
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise ModelLoadError(f"cannot read the tokenizer {path}: {exc}") from exc
        self._byte_level = any(
            component is not None and _mentions_byte_level(json.loads(component.__getstate__()))
            for component in (self._tok.pre_tokenizer, self._tok.decoder)
        )
        added = self._tok.get_added_tokens_decoder()
        # TOKEN_TEXT_RULE: special added tokens, markers among the others, and the unknown
        # token are not text
        self._special = {int(i) for i, t in added.items() if t.special or is_marker(t.content)}
        self._added_text = {int(i): str(t.content) for i, t in added.items() if not t.special}
        unk = getattr(self._tok.model, "unk_token", None)
        unk_id = self._tok.token_to_id(unk) if isinstance(unk, str) else None
        if unk_id is not None:
            self._special.add(int(unk_id))
        self._plain_lock = threading.Lock()  # encode_special_tokens is the tokenizer's state
        self._eos = frozenset(int(t) for t in eos_token_ids)
        super().__init__(
            n_vocab=n_vocab or self._tok.get_vocab_size(with_added_tokens=True),
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template=chat_template,
        )

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        with self._plain_lock:
            self._tok.encode_special_tokens = not parse_special
            try:
                ids = self._tok.encode(tokenizer_text(text), add_special_tokens=add_special).ids
                return list(ids)
            finally:
                self._tok.encode_special_tokens = False

    def _piece(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        text = self._tok.id_to_token(token_id)
        if text is None:  # padding ids past the tokenizer's vocabulary
            return b""
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            return b"".join(
                bytes([alphabet[c]]) if c in alphabet else c.encode("utf-8") for c in text
            )
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        return text.replace(_SPM_SPACE, " ").encode("utf-8")

    def is_end_of_generation(self, token_id: int) -> bool:
        return token_id in self._eos

    @property
    def size(self) -> int:
        """One past the largest id the tokenizer can produce (the graph needs that many rows)."""
        added = self._tok.get_added_tokens_decoder()
        return max([self._tok.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
