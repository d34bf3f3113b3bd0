"""One chat request with tools: the checked tools and choice, the call format of the model's
template, and what they change about the request (messages, sampling, stream)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..chat import validate_messages
from ..errors import InvalidRequestError
from ..generation import TokenStream
from ..sampling import SamplingConfig
from .formats import CallFormat, detect_format, generic_messages
from .spec import Tool, ToolChoice, check_parallel, check_tool_choice, check_tools
from .stream import ToolCallStream

__all__ = ["ToolRequest"]


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool
    format: CallFormat

    @classmethod
    def build(
        cls, tools: Any, tool_choice: Any, parallel_tool_calls: Any, template: str | None
    ) -> ToolRequest | None:
        """The checked request; None when the chat offers no tools and sets no choice."""
        if tools is None and tool_choice is None and parallel_tool_calls is None:
            return None
        checked = check_tools(tools)
        choice = check_tool_choice(tool_choice, checked)
        return cls(checked, choice, check_parallel(parallel_tool_calls), detect_format(template))

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

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` checked, as the template is to see them (see formats)."""
        checked = validate_messages(messages)
        return checked if self.format.native else generic_messages(checked, self.offered)

    def sampling(self, config: SamplingConfig) -> SamplingConfig:
        """``config``, with the grammar that forces a call when the choice requires one."""
        if not self.choice.constrained:
            return config
        if config.response_format is not None:
            raise InvalidRequestError(
                "response_format: cannot apply together with tool_choice "
                f"{self.choice.name or self.choice.mode!r} (the reply must be a call); "
                "leave one of them out"
            )
        grammar = self.format.grammar(self.tools, self.choice, self.parallel)
        return SamplingConfig.from_kwargs(
            config, response_format={"type": "grammar", "lark": grammar}
        )

    def wrap(self, stream: TokenStream) -> TokenStream:
        """The stream with calls found and checked (as it was under tool_choice "none")."""
        if self.choice.mode == "none":
            return stream
        return ToolCallStream(stream, self.tools, self.format)
