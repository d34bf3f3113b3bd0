"""A tiny random-weight Llama (or Qwen2: q/k/v biases, rotation of halves, untied output)
checkpoint with a tiny byte-level BPE tokenizer, built locally."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, crème brûlée. 你好世界, こんにちは. Emoji: 🙂🎉🍎.",
    "def add(a, b):\n    return a + b\n# numbers 0 1 2 3 4 5 6 7 8 9",
] * 20


def build_tiny_checkpoint(folder: Path, *, seed: int = 0, family: str = "llama") -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    config = config_class(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=family == "llama",
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():  # larger weights than the init: sharper, less tie-prone logits
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(8.0)
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases start at zero: make them count
                p.copy_(torch.randn_like(p))
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder, safe_serialization=True)
    return folder
