"""A chat with tools from start to end: what ``Model.chat`` does when it is given tools.

The tokenizer's marker tokens are found (markers.py), the conversation rendered in the
template's format, the reply generated under the choice's grammar and read by
``ToolCallStream``, which may ask once more (``retry``) through the same prompt.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

from ..chat import validate_messages
from ..errors import InvalidRequestError
from ..generation.results import GenerationResult, TokenStream
from ..generation.sampling import SamplingConfig
from .markers import find_markers
from .request import AUTO_MODES, ToolRequest
from .retry import answered_calls
from .spec import ToolChoice

__all__ = ["default_auto", "tool_chat"]


class Model(Protocol):
    """What of ``edgeinfer.Model`` a chat with tools uses (not imported: model.py imports
    this module)."""

    _tokenizer: Any

    @property
    def chat_template(self) -> str | None: ...

    def chat(self, messages: Any, config: Any = ..., **options: Any) -> Any: ...

    def _chat_request(
        self, messages: Any, parse_special: bool, tools: Any = ...
    ) -> tuple[list[int], int]: ...

    def _stream(
        self, ids: list[int], cfg: SamplingConfig, keep: int, wait: bool
    ) -> TokenStream: ...


def default_auto() -> tuple[str, bool]:
    """``auto`` and ``retry`` when the caller names neither: plain auto with the retry where
    llguidance (the ``structured`` extra, which forces the retried call) is installed, and
    without it where not. The grammar is not the default: the catalog's Qwen2.5-Coder
    models never open a call in the format under auto, so it changed no reply in
    benchmarks/tool_calls.py, and a grammar takes away the request's stop strings."""
    if importlib.util.find_spec("llguidance") is None:
        return "plain", False
    return "plain", True


def tool_chat(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    config: SamplingConfig | None = None,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    stream: bool = False,
    wait: bool = True,
    parse_special_in_content: bool = False,
    auto: str | None = None,
    retry: bool | None = None,
    **sampling: Any,
) -> GenerationResult | TokenStream:
    """``model.chat(messages, tools=..., ...)`` with the two settings of ``tool_choice="auto"``
    named: ``auto`` ("plain" or "grammar") and ``retry`` (see request.py); None: the default
    (``default_auto``)."""
    settings = _settings(auto, retry)
    if not isinstance(parse_special_in_content, bool):
        raise InvalidRequestError(
            f"parse_special_in_content={parse_special_in_content!r} is invalid: expected "
            "True or False"
        )
    cfg = SamplingConfig.from_kwargs(config, **sampling)
    built = ToolRequest.build(tools, tool_choice, parallel_tool_calls, model.chat_template)
    if built is None:
        return model.chat(  # type: ignore[call-overload, no-any-return]
            messages,
            cfg,
            stream=stream,
            wait=wait,
            parse_special_in_content=parse_special_in_content,
        )
    tokenizer = model._tokenizer
    markers = find_markers(tokenizer, built.format, model.chat_template)
    request = replace(built, markers=markers, auto=settings[0], retry=settings[1])
    checked = validate_messages(messages)
    ids, keep = _prompt(model, request, checked, parse_special_in_content)
    result = model._stream(ids, request.sampling(cfg), keep, wait)
    rerun = partial(_rerun, model, request, checked, parse_special_in_content, (ids, keep), wait)
    answered = answered_calls(checked)
    wrapped = request.wrap(result, cfg, tokenizer.token_bytes, rerun, answered)
    return wrapped if stream else wrapped.collect()


def _prompt(
    model: Model, request: ToolRequest, checked: list[dict[str, Any]], parse_special: bool
) -> tuple[list[int], int]:
    return model._chat_request(request.messages(checked), parse_special, request.template_tools)


def _rerun(
    model: Model,
    request: ToolRequest,
    checked: list[dict[str, Any]],
    parse_special: bool,
    prompt: tuple[list[int], int],
    wait: bool,
    cfg: SamplingConfig,
    without_tools: bool,
) -> TokenStream:
    """The conversation generated again under ``cfg``: the same prompt, or, for an answer in
    text, the prompt as tool_choice "none" renders it (no tools offered)."""
    if without_tools:
        prompt = _prompt(model, replace(request, choice=ToolChoice("none")), checked, parse_special)
    return model._stream(prompt[0], cfg, prompt[1], wait)


def _settings(auto: str | None, retry: bool | None) -> tuple[str, bool]:
    default_mode, default_retry = default_auto()
    mode = default_mode if auto is None else auto
    if mode not in AUTO_MODES:
        raise InvalidRequestError(f"auto={auto!r} is invalid: expected one of {AUTO_MODES}")
    if retry is not None and not isinstance(retry, bool):
        raise InvalidRequestError(f"retry={retry!r} is invalid: expected True or False")
    return mode, default_retry if retry is None else retry
