from __future__ import annotations

import pytest

from edgeinfer import ChatTemplateError, InvalidRequestError
from edgeinfer.chat_template import render_chat

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = [{"role": "user", "content": "Hi"}]


def render(template: str | None, messages: object = USER) -> str:
    return render_chat(template, messages, bos_token="<s>", eos_token="</s>")  # type: ignore[arg-type]


def test_renders_a_chatml_template() -> None:
    assert render(CHATML) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_bos_and_eos_are_available_to_the_template() -> None:
    assert render("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}") == "<s>Hi</s>"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # sandbox escape attempt
        "{{ messages.append(1) }}",  # immutable: no mutation of the caller's data
        "{% for %}",  # does not parse
        "{{ raise_exception('roles must alternate') }}",
        "{{ messages[5]['content'] }}",
    ],
)
def test_failing_templates_raise_chat_template_error(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render(template)


def test_missing_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render(None)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "Hi",
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": 3}],
        ["not a dict"],
    ],
)
def test_bad_messages_are_invalid_requests(messages: object) -> None:
    with pytest.raises(InvalidRequestError):
        render(CHATML, messages)
