"""A BERT sentence-transformers folder (safetensors, tokenizer.json, pooling config) as a GGUF
file llama.cpp runs in its embedding mode: architecture ``bert``, the folder's pooling as
``bert.pooling_type``, the WordPiece vocabulary in llama.cpp's form (``##`` pieces without
their marker, word starts with a leading U+2581), float32 or float16 weights.

Tensor names come from the ``gguf`` package's table for the architecture; the writer is the
``gguf`` package's. Written atomically (a temporary file in the same folder, then renamed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import ConversionError
from edgeinfer.files.encoder_folder import EncoderFolder, read_safetensors

__all__ = ["BERT_GGUF_FORMAT", "POOLING_TYPES", "write_bert_gguf"]

BERT_GGUF_FORMAT = 1  # bump when the output changes: cached conversions are rebuilt
POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}  # llama.cpp's enum llama_pooling_type
_SKIPPED = ("position_ids", "pooler.")  # buffers and the unused pooler head


def write_bert_gguf(folder: EncoderFolder, out: Path, outtype: str = "f32") -> Path:
    """Write ``folder`` as a BERT GGUF at ``out`` (``outtype`` "f32" or "f16")."""
    from .writer import import_gguf

    gguf = import_gguf()  # a ConversionError naming the package when it is missing

    if folder.config.model_type != "bert" or folder.pooling not in POOLING_TYPES:
        raise ConversionError(
            f"{folder.path}: only BERT encoders with mean, CLS or last-token pooling convert "
            f"to GGUF (this one: {folder.config.model_type}, {folder.pooling} pooling)"
        )
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(tmp), "bert")
    try:
        _metadata(writer, gguf, folder, outtype)
        _vocabulary(writer, folder)
        _tensors(writer, gguf, folder, outtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _metadata(writer: Any, gguf: Any, folder: EncoderFolder, outtype: str) -> None:
    cfg = folder.config
    writer.add_name(folder.path.name)
    writer.add_context_length(folder.max_seq_length)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(POOLING_TYPES[folder.pooling]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else 0)


def _vocabulary(writer: Any, folder: EncoderFolder) -> None:
    raw = json.loads(folder.tokenizer.read_text(encoding="utf-8"))
    vocab: dict[str, int] = raw["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    specials = {t["content"]: t["id"] for t in raw.get("added_tokens", []) if t.get("special")}
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([_phantom(t, t in specials) for t in tokens])
    writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
    writer.add_token_type_count(folder.config.type_vocab_size)
    ids = {name: specials.get(f"[{name.upper()}]", vocab.get(f"[{name.upper()}]")) for name in
           ("cls", "sep", "unk", "pad", "mask")}  # fmt: skip
    adders = [(writer.add_bos_token_id, "cls"), (writer.add_eos_token_id, "sep"),
              (writer.add_sep_token_id, "sep"), (writer.add_unk_token_id, "unk"),
              (writer.add_pad_token_id, "pad"), (writer.add_mask_token_id, "mask")]  # fmt: skip
    for add, name in adders:
        if ids[name] is not None:
            add(ids[name])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)


def _phantom(token: str, special: bool) -> str:
    """A WordPiece token in llama.cpp's form: a word start carries U+2581, a ``##`` piece
    loses its marker."""
    if special:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def _tensors(writer: Any, gguf: Any, folder: EncoderFolder, outtype: str) -> None:
    cfg = folder.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg.num_hidden_layers)
    for name, array in read_safetensors(folder.weights).items():
        short = name.removeprefix("bert.")
        if any(short.startswith(s) or short.endswith(s) for s in _SKIPPED):
            continue
        target = names.get_name(short, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ConversionError(f"{folder.weights}: no GGUF name for the tensor {name!r}")
        data = np.ascontiguousarray(array, dtype=np.float32)
        if target.startswith("position_embd"):
            # llama.cpp wants one row per position of the context, which is the folder's
            # maximum length (texts are cut there, so later rows are never read)
            data = np.ascontiguousarray(data[: folder.max_seq_length])
        # 2-D weights in float16 when asked; norms, biases and the type table stay float32
        if outtype == "f16" and data.ndim == 2 and not target.startswith("token_types"):
            data = data.astype(np.float16)
        writer.add_tensor(target, data)
