"""Render a model's own chat template in a sandbox.

Templates come from model files, so they are untrusted code: they run in Jinja2's
``ImmutableSandboxedEnvironment`` with only the variables chat templates expect.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from .errors import ChatTemplateError, InvalidRequestError

__all__ = ["render_chat", "validate_messages"]

_ROLES = frozenset({"system", "user", "assistant", "tool"})


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts; each needs a known role and string content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
        )
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] is {type(message).__name__}, not a dict")
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}]['role']={role!r}; expected one of {sorted(_ROLES)}"
            )
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}]['content'] must be a string")
        checked.append(dict(message))
    return checked


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the model's chat template refused the messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from exc


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for ``messages``, as the model was trained to see it."""
    from jinja2 import TemplateError

    if not template:
        raise ChatTemplateError(
            "this model has no chat template; use generate()/stream() with a plain prompt"
        )
    compiled = _compile(template)
    try:
        return str(
            compiled.render(
                messages=validate_messages(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token or "",
                eos_token=eos_token or "",
            )
        )
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise ChatTemplateError(f"the model's chat template failed to render: {exc}") from exc
