"""The tokens that end a generation in a GGUF file's vocabulary, decided as llama.cpp decides
them when it loads the file (its vocabulary loader, ``llama-vocab.cpp``), so that a folder
converted from the file stops where llama.cpp stops on the file itself.

llama.cpp's end-of-generation (EOG) set is the union of:

- the ``eos``, ``eot`` and ``eom`` ids of the metadata (``tokenizer.ggml.eos_token_id``, ...),
  each used only when it is a token of the vocabulary; a missing or out-of-range ``eos``
  falls back to the tokenizer model's default (2 for SentencePiece ``llama``, 11 for
  byte-level BPE ``gpt2``), itself used only when in range;
- the fill-in-the-middle pad, repository and file-separator ids (``fim_pad``, ``fim_rep``,
  ``fim_sep``), from the metadata or, when absent, the token with one of their texts
  (``<|fim_pad|>``, ``<|repo_name|>``, ``<|file_sep|>``, ...);
- every token whose text is one of ``EOG_TEXTS`` (``<|im_end|>``, ``<|endoftext|>``, ...),
  whatever its type (llama.cpp makes it a control token);

less ``<|end|>`` when ``<|return|>`` and ``<|call|>`` (or ``<|calls|>`` and ``<|flush|>``)
are in the set, and less ``</s>`` when ``<|tool_response>`` or ``<|plamo:eos|>`` is. Token
texts are unique (``gguf_checks`` refuses a file that repeats one: llama.cpp aborts on it).
Where a vocabulary holds two texts of one fill-in-the-middle kind and no metadata id,
llama.cpp takes one of them in its hash map's order; both are taken here (stopping on both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EOG_TEXTS", "end_of_generation_ids"]

EOG_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
     "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
     "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
     "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["}
)  # fmt: skip
# the texts llama.cpp finds a fill-in-the-middle token by when the metadata names none
_FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# llama.cpp's eos id when the metadata gives none, per tokenizer.ggml.model
_DEFAULT_EOS = {"llama": 2, "gpt2": 11, "hybriddna": 11, "whitespace": 11, "t5": 1, "plamo2": 2}
_NO_VOCAB = ("no_vocab", "none")


def end_of_generation_ids(metadata: Mapping[str, Any], tokens: Sequence[str]) -> tuple[int, ...]:
    """The sorted ids that end a generation for the vocabulary ``tokens`` (the file's
    ``tokenizer.ggml.tokens``) under the file's ``metadata``, as llama.cpp decides them."""
    n = len(tokens)
    model = metadata.get("tokenizer.ggml.model")
    if model in _NO_VOCAB or not n:
        return ()

    def special(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n
        return int(value) if ok else None

    ids = {i for i in (special("eot"), special("eom")) if i is not None}
    eos = special("eos")
    if eos is None:
        eos = _DEFAULT_EOS.get(str(model))
    if eos is not None and eos < n:
        ids.add(eos)
    by_text = {text: i for i, text in enumerate(tokens) if text}
    for key, texts in _FIM_TEXTS.items():
        given = special(key)
        found = [by_text[t] for t in texts if t in by_text]
        ids.update([given] if given is not None else found)
    ids.update(i for text, i in by_text.items() if text in EOG_TEXTS)
    _drop_exceptions(ids, tokens)
    return tuple(sorted(ids))


def _drop_exceptions(ids: set[int], tokens: Sequence[str]) -> None:
    """llama.cpp's two exceptions, applied to the finished set in place: ``<|end|>`` is a
    turn separator, not an end, beside ``<|return|>`` and ``<|call|>`` (or ``<|calls|>`` and
    ``<|flush|>``); ``</s>`` is a normal token beside ``<|tool_response>`` or
    ``<|plamo:eos|>``. The token of largest id carrying the text is the one dropped."""
    texts = {tokens[i] for i in ids}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if has_call and ("<|return|>" in texts or "<|flush|>" in texts) and "<|end|>" in texts:
        ids.discard(max(i for i in ids if tokens[i] == "<|end|>"))
    if ("<|tool_response>" in texts or "<|plamo:eos|>" in texts) and "</s>" in texts:
        ids.discard(max(i for i in ids if tokens[i] == "</s>"))
