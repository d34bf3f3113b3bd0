"""Chat prompts: messages to the text and token ids a model was trained on.

- ``template``: renders a model's own chat template, which is untrusted code, in Jinja2's
  sandbox within bounds of time, size and memory (``render_chat``, ``validate_messages``).
  Its private helpers: ``_budget`` (the bounds of one render and the deadline's tracer),
  ``_guards`` (size checks before steps that could make a huge value at once) and ``_env``
  (the sandboxed environment; it alone imports Jinja2, on the first render).
- ``builtin``: templates for models that ship without one, by format name
  (``BUILTIN_TEMPLATES``, ``resolve_chat_template`` for ``--chat-template``).
- ``_slots``: where the caller's strings lie in a rendered prompt, by construction (a second
  render with sentinels for them: ``render_chat_pieces`` gives a ``RenderedChat``).
- ``tokens``: the rendered prompt to ids, with message content read as plain text so a user
  cannot forge special tokens (``encode_messages``, ``encode_chat``, ``encode_plain``).

Importing this package loads neither Jinja2 nor an engine.
"""

from __future__ import annotations

from .builtin import BUILTIN_TEMPLATES, resolve_chat_template
from .template import RenderedChat, render_chat, render_chat_pieces, validate_messages
from .tokens import encode_chat, encode_messages, encode_plain

__all__ = [
    "BUILTIN_TEMPLATES",
    "RenderedChat",
    "encode_chat",
    "encode_messages",
    "encode_plain",
    "render_chat",
    "render_chat_pieces",
    "resolve_chat_template",
    "validate_messages",
]
