"""Chat templates for models that ship without one, by the name of the format they follow
(``edgeinfer chat MODEL --chat-template chatml``)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidRequestError

__all__ = ["BUILTIN_TEMPLATES", "resolve_chat_template"]

BUILTIN_TEMPLATES = {
    # <|im_start|>role ... <|im_end|> (Qwen, SmolLM and many fine-tunes)
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Llama 3: header ids around the role, <|eot_id|> after each turn
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
    # Gemma: user and model turns only; a system message is read as the user's
    "gemma": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>"
        "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] | trim }}"
        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
        "{% endif %}"
    ),
}


def resolve_chat_template(value: str) -> str:
    """A built-in template's name, or the path of a file holding a Jinja template."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    path = Path(value).expanduser()
    if not path.is_file():
        raise InvalidRequestError(
            f"--chat-template {value!r} is neither a built-in template "
            f"({', '.join(BUILTIN_TEMPLATES)}) nor a file"
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read the chat template {path}: {exc}") from exc
