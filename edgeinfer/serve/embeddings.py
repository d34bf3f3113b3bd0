"""``POST /v1/embeddings`` in OpenAI's shape, over ``Model.embed_detailed``.

Body: ``input`` (a string, a list of strings, a list of token ids or a list of such lists),
``model`` (optional: this server's name or "default"), ``encoding_format`` ("float", the
default, or "base64": the little-endian float32 bytes), ``dimensions`` (accepted only when it
equals the model's own dimension: the served models are not trained to be cut shorter, so a
shorter vector would be a different, worse embedding), ``user`` (ignored). Vectors are
L2-normalized, as OpenAI's are. Each item also says whether its input was ``truncated`` at the
model's maximum length; ``usage.prompt_tokens`` counts the tokens the model read.

Token ids index the *served model's* vocabulary (``0 .. vocab_size - 1``, as
``Model.tokenize`` gives them; ``GET /health`` says ``vocab_size``), not OpenAI's tiktoken
vocabularies: an id outside it is a 400 naming the range. The model reads the ids as given
(no [CLS]/[SEP] added: send them when the model expects them), cut at its maximum length as
texts are. Clients that tokenize with tiktoken before sending (LangChain's
``OpenAIEmbeddings`` does by default) get vectors of ids the model reads differently from
the text; set ``check_embedding_ctx_length=False`` there to send the text itself.

Every refusal is a 400 naming the field (``input[3]``, ``encoding_format``, ``dimensions``);
a served model that cannot embed is a 400 too. The embedding runs in a worker thread, one
batch at a time on the model.
"""

from __future__ import annotations

import base64
import logging
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..embedding.batches import MAX_TEXT_CHARS
from ..errors import InvalidRequestError
from . import wire
from .body import ClientLeft, read_json
from .embedding_ids import embed_token_ids, token_id_inputs
from .guard import key_matches
from .replies import RequestLine, not_embedding, unauthorized

if TYPE_CHECKING:
    from .endpoints import Context

__all__ = ["EmbeddingRequest", "embeddings", "parse_embeddings"]

logger = logging.getLogger("edgeinfer.serve")

_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
MAX_INPUTS = 2048  # OpenAI's own limit on the items of one request


class EmbeddingRequest:
    """A checked body: its texts, or its token-id lists (then ``texts`` is empty)."""

    def __init__(
        self,
        texts: list[str],
        model: str | None,
        base64: bool,
        ids: list[list[int]] | None = None,
    ) -> None:
        self.texts, self.model, self.base64, self.ids = texts, model, base64, ids


def parse_embeddings(body: Any, dim: int, vocab: int | None = None) -> EmbeddingRequest:
    """The body checked field by field; WireError 400 naming the field otherwise. Token ids
    are taken when ``vocab`` (the model's vocabulary size) is given."""
    if not isinstance(body, dict):
        raise wire.WireError(400, "the request body must be a JSON object", code="invalid_value")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise wire.bad(unknown[0], f"{wire.shown(unknown[0])} is not a field of this request")
    texts, ids = _inputs(body.get("input"), vocab)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise wire.bad("model", "model must be a string")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise wire.bad("encoding_format", "encoding_format must be 'float' or 'base64'")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or dims != dim):
        raise wire.bad(
            "dimensions",
            f"dimensions={wire.shown(dims)}: this model's vectors have {dim} dimensions and "
            "are not trained to be shortened; omit dimensions or pass it",
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise wire.bad("user", "user must be a string")
    return EmbeddingRequest(texts, model, fmt == "base64", ids)


def _inputs(value: Any, vocab: int | None) -> tuple[list[str], list[list[int]] | None]:
    if value is None:
        raise wire.bad("input", "input is required: a string or a list of strings")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise wire.bad("input", "input must be a string or a list of strings")
    if not value:
        raise wire.bad("input", "input is empty: give at least one string")
    if len(value) > MAX_INPUTS:
        raise wire.bad("input", f"input has {len(value)} items, more than {MAX_INPUTS}")
    if not isinstance(value[0], str) and vocab is not None:
        return [], token_id_inputs(value, vocab)
    for i, text in enumerate(value):
        if not isinstance(text, str):
            why = "a string, as input[0] is" if i else "a string or a list of token ids"
            raise wire.bad(f"input[{i}]", f"input[{i}] must be {why}")
        if len(text) > MAX_TEXT_CHARS:
            raise wire.bad(f"input[{i}]", f"input[{i}] has more than {MAX_TEXT_CHARS:,} characters")
    return value, None


async def embeddings(ctx: Context, request: Request) -> Response:
    line = RequestLine(ctx.access, request.method, request.url.path)
    try:
        reply = await _answer(ctx, request)
    except wire.WireError as exc:
        line(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)
    except InvalidRequestError as exc:  # the model's own checks: the same 400
        line(400)
        return JSONResponse(wire.WireError(400, str(exc), param="input").body(), status_code=400)
    except ClientLeft:
        line(499)
        return Response(status_code=499)
    line(200)
    return JSONResponse(reply)


async def _answer(ctx: Context, request: Request) -> dict[str, Any]:
    if ctx.key is not None and not key_matches(request.headers.get("authorization"), ctx.key):
        raise unauthorized()
    info = ctx.model.info
    if info.get("kind") != "embedding":
        raise not_embedding(ctx.config.name)
    body = await read_json(request, ctx.config.max_body_bytes)
    parsed = parse_embeddings(body, int(info["embedding_dim"]), int(info["vocab_size"]))
    wire.check_model(ctx.config.name, parsed.model, ctx.config.any_model_name)
    if parsed.ids is not None:
        result = await run_in_threadpool(embed_token_ids, ctx.model, parsed.ids)
    else:
        result = await run_in_threadpool(ctx.model.embed_detailed, parsed.texts)
    data = []
    for i, vector in enumerate(result.vectors):
        shown: Any = vector.tolist()
        if parsed.base64:
            shown = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        data.append(
            {
                "object": "embedding",
                "index": i,
                "embedding": shown,
                "truncated": result.truncated[i],
            }
        )
    tokens = sum(result.tokens)
    return {
        "object": "list",
        "data": data,
        "model": ctx.config.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
