"""A checkpoint's byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json) as GGUF
metadata, read and checked before the GGUF writer starts.

Both files come from whoever made the checkpoint: types, id ranges (every id below the
config's ``vocab_size``, so the token list matches the embedding) and the pre-tokenizer are
checked, and every failure is a ConversionError naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError

from ..sources.hf_config import read_json_object

__all__ = ["GGUFVocab", "read_vocab", "write_vocab"]

# Recognised byte-level BPE pre-tokenizers -> llama.cpp's tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp token types
_MAX_JSON = 512 * 2**20  # bytes; the largest real tokenizer.json files are ~30 MB


@dataclass(frozen=True)
class GGUFVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    special: dict[str, int | None]  # bos, eos, unk, pad
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def summary(self) -> dict[str, Any]:
        return {"model": "gpt2", "pre": self.pre, "tokens": len(self.tokens),
                "merges": len(self.merges), "add_bos": self.add_bos,
                **{f"{k}_id": v for k, v in self.special.items()}}  # fmt: skip


def read_vocab(checkpoint: Path, n_vocab: int) -> GGUFVocab:
    """The tokenizer of ``checkpoint`` as GGUF metadata for ``n_vocab`` embedding rows."""
    path = checkpoint / "tokenizer.json"
    spec = read_json_object(path, max_bytes=_MAX_JSON)
    cfg = read_json_object(checkpoint / "tokenizer_config.json", required=False)
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not _is_byte_level(spec):
        kind = model.get("type") if isinstance(model, dict) else None
        raise ConversionError(
            f"{checkpoint}: only byte-level BPE tokenizers (GPT-2 style: SmolLM, Llama 3, Qwen2) "
            f"are supported by the GGUF writer; this one is {kind} without a ByteLevel "
            "pre-tokenizer"
        )
    tokens, types = _token_table(path, model.get("vocab"), spec.get("added_tokens"), n_vocab)
    special = {key: _token_id(cfg, f"{key}_token", tokens) for key in ("bos", "eos", "unk", "pad")}
    template = cfg.get("chat_template")
    template_file = checkpoint / "chat_template.jinja"
    if not isinstance(template, str) and template_file.is_file():
        template = template_file.read_text(encoding="utf-8", errors="replace")
    return GGUFVocab(
        tokens=tokens,
        types=types,
        merges=_merges(path, model.get("merges")),
        pre=_pre_tokenizer(spec.get("pre_tokenizer")),
        special=special,
        add_bos=_adds_bos(spec, cfg, special["bos"], tokens),
        add_eos=cfg.get("add_eos_token") is True,
        chat_template=template if isinstance(template, str) else None,
    )


def write_vocab(writer: Any, vocab: GGUFVocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
              "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}  # fmt: skip
    for key, token in vocab.special.items():
        if token is not None:
            adders[key](token)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)


def _is_id(value: Any, n_vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_vocab


def _token_table(path: Path, vocab: Any, added: Any, n_vocab: int) -> tuple[list[str], list[int]]:
    """Token texts and llama.cpp types for ids 0..n_vocab-1 (unnamed ids become [PADi])."""
    if not isinstance(vocab, dict) or not vocab:
        raise ConversionError(f"{path}: model.vocab must be a non-empty JSON object")
    if not isinstance(added or [], list):
        raise ConversionError(f"{path}: added_tokens must be a list")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [_UNUSED] * n_vocab
    for text, i in vocab.items():
        if not _is_id(i, n_vocab):
            raise ConversionError(
                f"{path}: token {text!r:.40} has id {i!r:.20}, not one of the {n_vocab} ids "
                "config.json's vocab_size allows"
            )
        tokens[i], types[i] = text, _NORMAL
    for tok in added or []:
        content = tok.get("content") if isinstance(tok, dict) else None
        i = tok.get("id") if isinstance(tok, dict) else None
        if not isinstance(content, str) or not _is_id(i, n_vocab):
            raise ConversionError(
                f"{path}: added token {tok!r:.80} needs a text and an id below {n_vocab}"
            )
        tokens[i] = content
        types[i] = _CONTROL if tok.get("special") is True else _USER_DEFINED
    return tokens, types


def _merges(path: Path, merges: Any) -> list[str]:
    out = []
    for merge in merges or []:
        if isinstance(merge, list) and len(merge) == 2 and all(isinstance(m, str) for m in merge):
            merge = " ".join(merge)
        if not isinstance(merge, str):
            raise ConversionError(f"{path}: merge {merge!r:.40} is not 'a b' or [a, b]")
        out.append(merge)
    return out


def _token_id(cfg: dict[str, Any], key: str, tokens: list[str]) -> int | None:
    value = cfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, str):
        return next((i for i, t in enumerate(tokens) if t == value), None)
    return None


def _adds_bos(
    spec: dict[str, Any], cfg: dict[str, Any], bos: int | None, tokens: list[str]
) -> bool:
    """Whether the tokenizer puts BOS before a text: tokenizer_config's add_bos_token when
    present, else whether tokenizer.json's post-processor template starts with it (Llama 3)."""
    if "add_bos_token" in cfg:
        return cfg["add_bos_token"] is True
    if bos is None:
        return False
    post = spec.get("post_processor") or {}
    steps = post.get("processors", [post]) if isinstance(post, dict) else []
    for step in steps if isinstance(steps, list) else []:
        single = step.get("single") if isinstance(step, dict) else None
        if single and isinstance(single, list):
            first = single[0].get("SpecialToken", {}) if isinstance(single[0], dict) else {}
            return isinstance(first, dict) and first.get("id") == tokens[bos]
    return False


def _is_byte_level(spec: dict[str, Any]) -> bool:
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    return '"ByteLevel"' in text


def _pre_tokenizer(node: Any) -> str:
    """llama.cpp's name for the pre-tokenizer, or ConversionError if it is not one it knows."""
    parts = node.get("pretokenizers", [node]) if isinstance(node, dict) else []
    parts = [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        pattern = parts[0].get("pattern")
        regex = pattern.get("Regex", "") if isinstance(pattern, dict) else ""
        if regex == _LLAMA3_SPLIT:
            return "llama-bpe"
        if regex == _QWEN2_SPLIT:
            return "qwen2"
    raise ConversionError(
        f"the tokenizer's pre-tokenizer ({', '.join(map(str, kinds)) or 'none'}) is not one "
        "the GGUF writer knows (GPT-2, SmolLM, Llama 3, Qwen2)"
    )
