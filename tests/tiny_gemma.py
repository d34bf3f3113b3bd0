"""A tiny random-weight Gemma 3 text model with a SentencePiece vocabulary, built locally.

``build_tiny_gemma_checkpoint`` trains a small SentencePiece BPE model (byte fallback, the
Gemma special and user-defined pieces), converts it to ``tokenizer.json`` with transformers'
Gemma converter, and saves a ``Gemma3ForCausalLM`` (six layers: five sliding-window, one
global, as in llama.cpp's default Gemma 3 pattern) as safetensors. ``write_tiny_gemma_gguf``
writes the same weights and vocabulary as an F32 GGUF of llama.cpp's ``gemma3`` architecture
with the ``gguf`` package's writer: tensor names come from the package's own tensor map, and
RMSNorm weights get the +1 that Gemma's norm applies at run time (llama.cpp multiplies by the
stored weight alone).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_PIECES = {
    "pad": (0, "<pad>"),
    "eos": (1, "<eos>"),
    "bos": (2, "<bos>"),
    "unk": (3, "<unk>"),
}
USER_DEFINED = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<table>")
# marked special in tokenizer.json (never shown as text); '<table>' stays a plain added token
SPECIAL_ADDED = USER_DEFINED[:4]
SLIDING_WINDOW = 16  # tokens: prompts longer than this cross the window
N_LAYERS = 6  # layers 0-4 sliding, layer 5 global (llama.cpp's default Gemma 3 pattern is 6)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] ~ '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ ((first if loop.first else '') ~ m['content']) | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village, there lived an old clockmaker and his cat.",
    "Café, naïve, résumé, crème brûlée, déjà vu. Ça va très bien, merci beaucoup!",
    "Der schnelle braune Fuchs springt über den faulen Hund. Straße, Grüße, Mädchen.",
    "El niño comió una manzana en la mañana. ¿Dónde está la biblioteca? ¡Olé!",
    "你好世界\uff0c今天天气很好。我们去公园散步吧。こんにちは、世界\uff01ありがとう。",
    "Привет, мир! Как дела? Всё хорошо, спасибо. Emoji: 🙂🎉🍎👍",
    "def add(a, b):\n    return a + b\n# numbers 0 1 2 3 4 5 6 7 8 9 10 2024 3.14",
    "<start_of_turn>user\nWhat is the weather like?<end_of_turn>\n<start_of_turn>model\nSunny.",
]


def build_tiny_gemma_checkpoint(folder: Path, *, seed: int = 0) -> Path:
    """Write a tiny Gemma 3 checkpoint (config, safetensors, tokenizer files) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    model_file = train_sentencepiece(folder / "tokenizer.model")
    vocab_size = save_tokenizer(model_file, folder)
    save_model(folder, vocab_size, seed=seed)
    return folder


def train_sentencepiece(path: Path, *, vocab_size: int = 640) -> Path:
    """Train a SentencePiece BPE model laid out like Gemma's: pad/eos/bos/unk at 0-3, then
    the user-defined pieces, the 256 byte pieces, then merges."""
    import sentencepiece as spm

    path.parent.mkdir(parents=True, exist_ok=True)
    ids = {f"{kind}_id": i for kind, (i, _) in SPECIAL_PIECES.items()}
    pieces = {f"{kind}_piece": text for kind, (_, text) in SPECIAL_PIECES.items()}
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 8),
        model_prefix=str(path.with_suffix("")),
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        user_defined_symbols=list(USER_DEFINED),
        num_threads=1,
        minloglevel=2,
        **ids,
        **pieces,
    )
    path.with_suffix(".vocab").unlink(missing_ok=True)
    return path


def save_tokenizer(model_file: Path, folder: Path) -> int:
    """tokenizer.json and tokenizer_config.json from the SentencePiece model; returns the
    vocabulary size."""
    from transformers import GemmaTokenizerFast

    tokenizer = GemmaTokenizerFast(
        vocab_file=str(model_file),
        bos_token=SPECIAL_PIECES["bos"][1],
        eos_token=SPECIAL_PIECES["eos"][1],
        unk_token=SPECIAL_PIECES["unk"][1],
        pad_token=SPECIAL_PIECES["pad"][1],
        additional_special_tokens=list(SPECIAL_ADDED),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    _mark_special(folder)
    return len(tokenizer)


def _mark_special(folder: Path) -> None:
    """transformers' converter adds the user-defined pieces as non-special added tokens;
    Gemma 3's own files mark its turn and image markers special: do the same."""
    tok_path, cfg_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    tok, cfg = json.loads(tok_path.read_text()), json.loads(cfg_path.read_text())
    for entry in tok["added_tokens"]:
        entry["special"] = entry["special"] or entry["content"] in SPECIAL_ADDED
    for entry in cfg["added_tokens_decoder"].values():
        entry["special"] = entry["special"] or entry["content"] in SPECIAL_ADDED
    tok_path.write_text(json.dumps(tok, ensure_ascii=False, indent=2))
    cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2))


def gemma_config(vocab_size: int) -> Any:
    from transformers import Gemma3TextConfig

    head_dim = 16
    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        # llama.cpp scales queries by 1/sqrt(head_dim) (all sizes but 27B)
        query_pre_attn_scalar=head_dim,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention"] * (N_LAYERS - 1) + ["full_attention"],
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        pad_token_id=SPECIAL_PIECES["pad"][0],
        eos_token_id=SPECIAL_PIECES["eos"][0],
        bos_token_id=SPECIAL_PIECES["bos"][0],
    )


def save_model(folder: Path, vocab_size: int, *, seed: int) -> None:
    import torch
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma_config(vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma norms start at 0 (scale 1 + w): vary them
                p.normal_(0.0, 0.3)
            else:  # larger weights than the init: sharper, less tie-prone logits
                p.mul_(6.0)
    model.generation_config.eos_token_id = [
        SPECIAL_PIECES["eos"][0],
        _piece_id(folder, "<end_of_turn>"),
    ]
    model.save_pretrained(folder, safe_serialization=True)


def _piece_id(folder: Path, piece: str) -> int:
    import sentencepiece as spm

    return int(spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))[piece])


# -- GGUF --------------------------------------------------------------------------------------


def write_tiny_gemma_gguf(checkpoint: Path, out: Path) -> Path:
    """Write ``checkpoint`` (built above) as an F32 GGUF of llama.cpp's ``gemma3``."""
    import gguf

    config = json.loads((checkpoint / "config.json").read_text())
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA3]
    writer = gguf.GGUFWriter(str(out), arch)
    _add_hparams(writer, config, arch)
    _add_vocabulary(writer, checkpoint)
    for name, data in _gguf_tensors(checkpoint, int(config["num_hidden_layers"])):
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_hparams(writer: Any, config: dict[str, Any], arch: str) -> None:
    writer.add_name("tiny-gemma3")
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config["num_key_value_heads"]))
    writer.add_key_length(int(config["head_dim"]))
    writer.add_value_length(int(config["head_dim"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_freq_base(float(config["rope_theta"]))  # global layers
    writer.add_float32(f"{arch}.rope.freq_base_swa", float(config["rope_local_base_freq"]))
    writer.add_sliding_window(int(config["sliding_window"]))
    # every Nth layer is global: the HF layer_types written as llama.cpp's integer pattern
    pattern = config["layer_types"].index("full_attention") + 1
    writer.add_uint32(f"{arch}.attention.sliding_window_pattern", pattern)
    writer.add_file_type(0)  # all F32


def _add_vocabulary(writer: Any, checkpoint: Path) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(checkpoint / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(_token_type(sp, i))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    for kind, (token_id, _) in SPECIAL_PIECES.items():
        getattr(writer, f"add_{'unk' if kind == 'unk' else kind}_token_id")(token_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _token_type(sp: Any, token_id: int) -> int:
    """llama.cpp's token types (the gguf package's TokenType: SentencePiece's own numbering)."""
    import gguf

    if sp.is_unknown(token_id):
        return int(gguf.TokenType.UNKNOWN)
    if sp.is_control(token_id):
        return int(gguf.TokenType.CONTROL)
    if sp.is_byte(token_id):
        return int(gguf.TokenType.BYTE)
    if sp.is_unused(token_id):
        return int(gguf.TokenType.UNUSED)
    if sp.id_to_piece(token_id) in USER_DEFINED:
        return int(gguf.TokenType.USER_DEFINED)
    return int(gguf.TokenType.NORMAL)


def _gguf_tensors(checkpoint: Path, n_layers: int) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 data in Hugging Face's [out, in] layout) for every weight."""
    import gguf
    from safetensors.numpy import load_file

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, n_layers)
    out = []
    for hf_name, data in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        if hf_name == "lm_head.weight":  # tied to the embeddings
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        array = np.asarray(data, dtype=np.float32)
        if hf_name.endswith("norm.weight"):  # Gemma's RMSNorm scales by (1 + weight)
            array = array + np.float32(1.0)
        out.append((gguf_name, np.ascontiguousarray(array)))
    return out
