"""What the server answers besides generated text: error bodies in OpenAI's shape (one
function per refusal, each a ``wire.WireError``), and the access log (one line per request).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import EdgeInferError, InvalidRequestError, ModelBusyError
from ..generation.results import GenerationResult
from . import wire

__all__ = [
    "AccessLog",
    "RequestLine",
    "busy",
    "figures",
    "invalid",
    "no_chat_template",
    "not_embedding",
    "not_generative",
    "server_error",
    "shutting_down",
    "too_large",
    "unauthorized",
]

access = logging.getLogger("edgeinfer.serve.access")


# -- error bodies -----------------------------------------------------------------------------


def invalid(
    exc: InvalidRequestError, prompt: str = "messages", names: dict[str, str] | None = None
) -> wire.WireError:
    """The 400 of a request the model refused: a prompt over the context names ``prompt``
    (the request's field holding it), a setting names its field (``names`` maps edgeinfer's
    setting names to the request's where they differ from ``_PARAMS``)."""
    text = str(exc)
    if "context holds" in text:
        return wire.WireError(400, text, param=prompt, code="context_length_exceeded")
    first = text.split(" ", 1)[0].split("=", 1)[0].rstrip(":")  # the setting's name first
    table = _PARAMS | (names or {})
    param = table.get(first, first if first in table.values() else None)
    return wire.WireError(400, text, param=param, code="invalid_value")


# edgeinfer's sampling names as the request's fields
_PARAMS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "logit_bias": "logit_bias",
    "response_format": "response_format",
    "speculative": "speculative",
}


def not_generative(name: str) -> wire.WireError:
    """Chat, completions or responses asked of a server whose model embeds."""
    return wire.WireError(
        400,
        f"this server serves an embedding model ({name}): it embeds text and cannot chat or "
        'complete; POST /v1/embeddings with {"input": ...}, or start edgeinfer serve with a '
        "text-generation model for /v1/chat/completions, /v1/completions and /v1/responses",
        param="model",
        code="model_cannot_generate",
    )


def no_chat_template(name: str) -> wire.WireError:
    """Chat or responses asked of a model that has no chat template."""
    return wire.WireError(
        400,
        f"the model served here ({name}) has no chat template, so it cannot take messages: "
        'POST /v1/completions with {"prompt": ...}, or serve a model that has one',
        param="messages",
        code="no_chat_template",
    )


def not_embedding(name: str) -> wire.WireError:
    """Embeddings asked of a server whose model generates text."""
    return wire.WireError(
        400,
        f"this server serves a text-generation model ({name}) and cannot embed: POST "
        "/v1/chat/completions, /v1/completions or /v1/responses; for /v1/embeddings start "
        "edgeinfer serve with an embedding model such as all-minilm-l6-v2",
        param="model",
        code="model_cannot_embed",
    )


def server_error(exc: BaseException) -> wire.WireError:
    if isinstance(exc, ModelBusyError):
        return wire.WireError(503, str(exc), code="server_busy", kind="server_error")
    message = str(exc) if isinstance(exc, EdgeInferError) else "internal error"
    return wire.WireError(500, message, kind="server_error")


def shutting_down() -> wire.WireError:
    return wire.WireError(
        503,
        "the server is shutting down; the request was not completed, retry it later",
        code="server_shutting_down",
        kind="server_error",
    )


def busy(waiting: int) -> wire.WireError:
    return wire.WireError(
        503,
        f"the server is busy ({waiting} requests waiting); retry shortly",
        code="server_busy",
        kind="server_error",
    )


def too_large(limit: int) -> wire.WireError:
    return wire.WireError(
        413, f"the request body is larger than {limit:,} bytes", code="request_too_large"
    )


def unauthorized() -> wire.WireError:
    return wire.WireError(
        401,
        "missing or wrong API key: send 'Authorization: Bearer KEY'",
        code="invalid_api_key",
        kind="authentication_error",
    )


# -- the access log ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AccessLog:
    """Writes one line per request: ``key=value`` pairs, or a JSON object (``--log-json``)."""

    as_json: bool = False

    def write(self, fields: dict[str, Any], t0: float) -> None:
        fields = fields | {"ms": round((time.perf_counter() - t0) * 1000, 1)}
        if self.as_json:
            access.info("%s", json.dumps(fields, ensure_ascii=False))
        else:
            access.info("%s", " ".join(f"{k}={v}" for k, v in fields.items()))

    def refused(self, fields: dict[str, Any], status: int) -> None:
        """A request the Host/Origin guard refused before any route ran."""
        self.write(fields, time.perf_counter())


@dataclass(frozen=True)
class RequestLine:
    """One request's access line, written once its status is known."""

    log: AccessLog
    method: str
    path: str
    t0: float = field(default_factory=time.perf_counter)
    stream: bool = False

    def __call__(self, status: int, figures: dict[str, Any] | None = None) -> None:
        fields: dict[str, Any] = {"method": self.method, "path": self.path}
        if self.stream:
            fields["stream"] = True
        self.log.write(fields | {"status": status} | (figures or {}), self.t0)


def figures(result: GenerationResult | None, tokens_at_cancel: int | None) -> dict[str, Any]:
    """A finished generation's figures for its access line."""
    if result is None:
        return {}
    s = result.stats
    out = {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "ttft_ms": round(s.ttft_s * 1000, 1),
        "decode_tok_s": round(s.decode_tokens_per_s, 1),
        "finish_reason": result.finish_reason,
    }
    if tokens_at_cancel is not None and result.finish_reason == "cancelled":
        # how far generation ran after the cancel was seen: what a late cancel costs
        out["tokens_after_cancel"] = s.completion_tokens - tokens_at_cancel
    return out
