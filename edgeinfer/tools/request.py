"""One chat request with tools: the checked tools and choice, the call format of the model's
template, and what they change about the request (messages, sampling, stream).

``auto`` says how ``tool_choice="auto"`` generates: ``"plain"``, the model writes freely and
its calls are checked afterwards; ``"grammar"``, the model still chooses between text and a
call, but a call it opens is held to a function and its schema (formats.auto_grammar; tagged
formats only, and only when the request sets no response_format and no stop strings, which a
grammar would override). ``retry``: a failed call under auto is asked again once with the
call forced (stream.py). ``markers``: the call markers the tokenizer holds as tokens and the
result markers that end a reply (markers.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..chat import validate_messages
from ..errors import InvalidRequestError
from ..generation.results import TokenStream
from ..generation.sampling import SamplingConfig
from .formats import CallFormat, detect_format, generic_messages
from .markers import Markers, ReplyText, result_markers
from .retry import CALL, RetryPlan
from .spec import Tool, ToolChoice, check_parallel, check_tool_choice, check_tools
from .stream import ToolCallStream

__all__ = ["AUTO_MODES", "ToolRequest"]

AUTO_MODES = ("plain", "grammar")
# the same conversation generated again under a config (``True``: rendered as under "none")
Rerun = Callable[[SamplingConfig, bool], TokenStream]


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool
    format: CallFormat
    markers: Markers = field(default_factory=Markers)
    auto: str = "plain"
    retry: bool = False

    @classmethod
    def build(
        cls, tools: Any, tool_choice: Any, parallel_tool_calls: Any, template: str | None
    ) -> ToolRequest | None:
        """The checked request; None when the chat offers no tools and sets no choice."""
        if tools is None and tool_choice is None and parallel_tool_calls is None:
            return None
        checked = check_tools(tools)
        choice = check_tool_choice(tool_choice, checked)
        fmt = detect_format(template)
        markers = Markers(cut=result_markers(fmt, template))
        return cls(checked, choice, check_parallel(parallel_tool_calls), fmt, markers)

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model is told about (none under tool_choice "none")."""
        return () if self.choice.mode == "none" else self.tools

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` for a template that renders them itself; None otherwise."""
        if not self.format.native or not self.offered:
            return None
        return [tool.as_openai() for tool in self.offered]

    @property
    def _tokens(self) -> dict[str, int]:
        return {text: i for i, text in self.markers.tokens.items()}

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` checked, as the template is to see them (see formats)."""
        checked = validate_messages(messages)
        return checked if self.format.native else generic_messages(checked, self.offered)

    def sampling(self, config: SamplingConfig) -> SamplingConfig:
        """``config``, with the grammar that forces a call when the choice requires one (or
        that holds auto's calls to their schemas, under ``auto="grammar"``)."""
        if self.choice.constrained:
            return self.forced(config, self.choice.name)
        if self.constrains_auto(config):
            grammar = self.format.auto_grammar(self.tools, self.parallel, self._tokens)
            return SamplingConfig.from_kwargs(
                config, response_format={"type": "grammar", "lark": grammar}
            )
        return config

    def constrains_auto(self, config: SamplingConfig) -> bool:
        """Whether auto's calls are held to their schemas by a grammar for ``config``."""
        return (
            self.auto == "grammar"
            and self.choice.mode == "auto"
            and self.format.name in ("hermes", "generic")
            and config.response_format is None
            and not config.stop
        )

    def forced(self, config: SamplingConfig, name: str | None) -> SamplingConfig:
        """``config`` with the grammar that forces a call (to ``name``, or any tool)."""
        if config.response_format is not None:
            raise InvalidRequestError(
                "response_format: cannot apply together with tool_choice "
                f"{name or self.choice.mode!r} (the reply must be a call); "
                "leave one of them out"
            )
        choice = ToolChoice("required", name)
        grammar = self.format.grammar(self.tools, choice, self.parallel, self._tokens)
        return SamplingConfig.from_kwargs(
            config, response_format={"type": "grammar", "lark": grammar}
        )

    def wrap(
        self,
        stream: TokenStream,
        base: SamplingConfig | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
        rerun: Rerun | None = None,
        answered: frozenset[tuple[str, str]] = frozenset(),
    ) -> TokenStream:
        """The stream with calls found and checked, and ended at a tool-result marker.

        ``base``: the request's sampling before ``sampling()`` (the stream runs under
        ``sampling(base)``, whose stop strings are read again with the markers written
        out); ``token_bytes``: the tokenizer's, to read marker tokens; ``rerun``: generates
        the conversation again (the retry); ``answered``: retry.answered_calls."""
        if self.choice.mode == "none" and not self.markers.cut:
            return stream
        reply = self._reply(self.sampling(base) if base is not None else None, token_bytes)
        plan = None
        if self._may_retry(base) and rerun is not None and base is not None:
            plan = RetryPlan(partial(self._again, base, token_bytes, rerun), answered)
        return ToolCallStream(
            stream,
            self.tools,
            self.format,
            reply=reply,
            cut=self.markers.cut,
            retry=plan,
            find_calls=self.choice.mode != "none",
        )

    def _again(
        self,
        base: SamplingConfig,
        token_bytes: Callable[[int], bytes] | None,
        rerun: Rerun,
        kind: str,
        name: str | None,
    ) -> tuple[TokenStream, ReplyText]:
        """The retry's second try: the call forced (to ``name``), or text under "none"."""
        config = self.forced(base, name) if kind == CALL else base
        return rerun(config, kind != CALL), self._reply(config, token_bytes)

    def _may_retry(self, base: SamplingConfig | None) -> bool:
        return (
            self.retry
            and self.choice.mode == "auto"
            and base is not None
            and base.response_format is None
        )

    def _reply(
        self, config: SamplingConfig | None, token_bytes: Callable[[int], bytes] | None
    ) -> ReplyText:
        stop = config.stop if config is not None and config.response_format is None else ()
        return ReplyText(token_bytes, self.markers, stop)
