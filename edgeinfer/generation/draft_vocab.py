"""Whether a draft model shares its target's vocabulary exactly, checked at load.

A draft proposes token ids; the target reads them as its own. That is only right when every
id means the same token in both: the same bytes, the same type (special or not) and, for a
BPE vocabulary, the same merges. ``check_files`` compares what the files say before either
engine opens: two GGUF files their ``tokenizer.ggml.*`` arrays (byte for byte, read raw from
the header), two ONNX folders their tokenizer.json (the vocabulary, added tokens, merges and
decoder). ``check_tokenizers`` compares two opened tokenizers id by id (a GGUF beside an
ONNX folder). A difference raises ``InvalidRequestError`` naming both models and the first
id (or merge) where they part.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..bounded_json import parse_json, read_regular_file
from ..errors import InvalidRequestError, ModelLoadError

__all__ = ["check_files", "check_tokenizers"]

_TOKENS, _TYPES, _MERGES = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAX_TOKENIZER_JSON = 256 * 2**20


def check_files(target: Any, draft: Any, setting: str) -> bool:
    """Compare the vocabularies of two resolved models (``loader.ModelSource``) of one
    format; True when compared, False when their formats differ (``check_tokenizers``
    then compares the opened tokenizers)."""
    if target.format == draft.format == "gguf":
        _compare_gguf(target, draft, setting)
        return True
    if target.format == draft.format == "onnx":
        _compare_tokenizer_json(target, draft, setting)
        return True
    return False


def check_tokenizers(target: Any, draft: Any, names: tuple[str, str], setting: str) -> None:
    """Compare two opened tokenizers id by id: count, bytes, end of generation."""
    if target.n_vocab != draft.n_vocab:
        raise _differ(names, setting, f"{target.n_vocab} tokens against {draft.n_vocab}")
    for i in range(target.n_vocab):
        a, b = target.token_bytes(i), draft.token_bytes(i)
        if a != b or target.is_end_of_generation(i) != draft.is_end_of_generation(i):
            raise _differ(names, setting, f"token id {i} is {a!r} against {b!r}")


def _differ(names: tuple[str, str], setting: str, where: str) -> InvalidRequestError:
    target, draft = names
    return InvalidRequestError(
        f"speculative={setting!r:.120}: the draft model {draft} does not share the vocabulary "
        f"of {target} ({where}, {target}'s first); a draft model must have its target's "
        "vocabulary exactly (every token, its type, the merges): use a smaller model of the "
        "same family, or speculative='auto' (prompt lookup)"
    )


# -- two GGUF files --------------------------------------------------------------------------


def _compare_gguf(target: Any, draft: Any, setting: str) -> None:
    names = (target.name, draft.name)
    a, b = _raw_arrays(Path(target.path)), _raw_arrays(Path(draft.path))
    for key in (_TOKENS, _TYPES, _MERGES):
        if a.get(key) == b.get(key):
            continue
        if key not in a or key not in b:
            has = target.name if key in a else draft.name
            raise _differ(names, setting, f"only {has} has {key}")
        items_a, items_b = _items(a[key]), _items(b[key])
        what = "merge" if key == _MERGES else "token id"
        raise _differ(names, setting, _first_difference(items_a, items_b, what, key))
    width_a, width_b = _vocab_size(target.header), _vocab_size(draft.header)
    if width_a != width_b:
        raise _differ(names, setting, f"logits over {width_a} tokens against {width_b}")


def _vocab_size(header: Any) -> int:
    tokens = header.metadata.get(_TOKENS)
    return int(header.arch_value("vocab_size", 0) or getattr(tokens, "length", 0) or 0) or (
        len(tokens) if isinstance(tokens, list) else 0
    )


def _first_difference(a: Sequence[Any], b: Sequence[Any], what: str, key: str) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            kind = "type" if key == _TYPES else ""
            return f"{what} {i} has {kind + ' ' if kind else ''}{x!r} against {y!r}"
    return f"{key} holds {len(a)} entries against {len(b)}"


def _raw_arrays(path: Path) -> dict[str, bytes]:
    """The encoded values (element type, count, elements) of the tokenizer arrays in a GGUF
    header that ``resolve`` already checked; raw bytes, so tokens compare byte for byte."""
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            (n_kv,) = struct.unpack_from("<Q", buf, 16)
            pos, found = 24, {}
            for _ in range(n_kv):
                (length,) = struct.unpack_from("<Q", buf, pos)
                key = bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8", "replace")
                (vtype,) = struct.unpack_from("<I", buf, pos + 8 + length)
                start = pos + 12 + length
                pos = _skip(buf, start, vtype)
                if key in (_TOKENS, _TYPES, _MERGES) and vtype == _ARRAY:
                    found[key] = bytes(buf[start:pos])
            return found
    except (OSError, struct.error, ValueError) as exc:
        raise ModelLoadError(f"cannot read the vocabulary of {path}: {exc}") from exc


def _skip(buf: Any, pos: int, vtype: int) -> int:
    """The offset after a value of type ``vtype`` at ``pos``."""
    if vtype in _SCALARS:
        return pos + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype != _ARRAY:
        raise ValueError(f"unknown value type {vtype} at offset {pos}")
    element, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if element in _SCALARS:
        return pos + count * struct.calcsize(_SCALARS[element])
    if element != _STRING:
        raise ValueError(f"an array of type {element} at offset {pos}")
    unpack = struct.Struct("<Q").unpack_from
    for _ in range(count):
        pos += 8 + unpack(buf, pos)[0]
    if pos > len(buf):
        raise ValueError("an array runs past the end of the file")
    return pos


def _items(raw: bytes) -> list[Any]:
    """The elements of one encoded array: bytes for strings, numbers otherwise."""
    element, count = struct.unpack_from("<IQ", raw, 0)
    if element in _SCALARS:
        return list(struct.unpack_from(f"<{count}{_SCALARS[element][1:]}", raw, 12))
    items, pos = [], 12
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", raw, pos)
        items.append(raw[pos + 8 : pos + 8 + length])
        pos += 8 + length
    return items


# -- two ONNX folders ------------------------------------------------------------------------


def _compare_tokenizer_json(target: Any, draft: Any, setting: str) -> None:
    names = (target.name, draft.name)
    width_a, width_b = target.header.architecture.vocab_size, draft.header.architecture.vocab_size
    if width_a != width_b:
        raise _differ(names, setting, f"logits over {width_a} tokens against {width_b}")
    paths = [Path(s.path) / s.header.tokenizer_file for s in (target, draft)]
    raw = [read_regular_file(p, max_bytes=_MAX_TOKENIZER_JSON, error=ModelLoadError) for p in paths]
    if raw[0] == raw[1]:
        return
    a, b = (
        parse_json(r, what=str(p), error=ModelLoadError) for r, p in zip(raw, paths, strict=True)
    )
    ids_a, ids_b = _json_tokens(a), _json_tokens(b)
    if ids_a != ids_b:
        keys = sorted(set(ids_a) | set(ids_b))
        first = next(i for i in keys if ids_a.get(i) != ids_b.get(i))
        raise _differ(names, setting, f"token id {first} is {ids_a.get(first)!r} against "
                                      f"{ids_b.get(first)!r}")  # fmt: skip
    merges_a, merges_b = _json_merges(a), _json_merges(b)
    if merges_a != merges_b:
        raise _differ(names, setting, _first_difference(merges_a, merges_b, "merge", "merges"))
    for part in ("type", "decoder"):
        if _part(a, part) != _part(b, part):
            raise _differ(names, setting, f"the tokenizer's {part} differs")


def _part(data: Any, part: str) -> Any:
    if part == "type":
        model = data.get("model") if isinstance(data, dict) else None
        return model.get("type") if isinstance(model, dict) else None
    return data.get(part) if isinstance(data, dict) else None


def _json_tokens(data: Any) -> dict[int, tuple[str, bool]]:
    """id -> (text, special) of a tokenizer.json: its model's vocabulary (a mapping, or
    Unigram's list of pieces) and its added tokens."""
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids: dict[int, tuple[str, bool]] = {}
    if isinstance(vocab, dict):
        ids = {i: (str(t), False) for t, i in vocab.items() if isinstance(i, int)}
    elif isinstance(vocab, list):
        ids = {
            i: (str(p[0] if isinstance(p, list) and p else p), False) for i, p in enumerate(vocab)
        }
    added_tokens = data.get("added_tokens") if isinstance(data, dict) else None
    for added in added_tokens if isinstance(added_tokens, list) else ():
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            ids[added["id"]] = (str(added.get("content")), bool(added.get("special")))
    return ids


def _json_merges(data: Any) -> list[str]:
    model = data.get("model") if isinstance(data, dict) else None
    merges = model.get("merges") if isinstance(model, dict) else None
    if not isinstance(merges, list):
        return []
    return [" ".join(map(str, m)) if isinstance(m, list) else str(m) for m in merges]
