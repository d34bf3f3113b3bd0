"""Model: the public handle over one backend — generate, stream, chat, tokenize."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from .chat import encode_messages, render_chat
from .embedding.batches import EmbedResult, GivenIds, embed_for_model, require_generation
from .errors import EdgeInferError, InvalidRequestError
from .generation import scoring
from .generation.delivery import Submitted
from .generation.generate_many import Request, collect_in_order, read_request
from .generation.results import Chunk, GenerationResult, KVHistory, TokenStream, check_request
from .generation.sampling import SamplingConfig
from .generation.scheduler import Engine
from .generation.scoring import Scores
from .generation.speculative import OFF, PassCosts, SpeculativeConfig, check_setting, for_request
from .generation.state import session
from .generation.state.sequence import SeqStates
from .generation.turns import OpenStreams, Turns
from .memory.budget import MemoryPlan
from .model_guards import attach_cache, check_flag, check_overflow, checked_token_ids, signals_held
from .tools.run import tool_chat

if TYPE_CHECKING:
    from .runtimes.base import Backend

__all__ = ["Model"]

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]


class Model:
    """A loaded model; requests run through its one generation loop, reusing the KV cache.
    Make one with ``edgeinfer.load(...)``; ``close()`` (or ``with``) frees it."""

    def __init__(
        self,
        backend: Backend,
        *,
        name: str,
        path: Path,
        model_format: str,
        provider_chain: Sequence[Mapping[str, Any]] = (),
        memory_plan: MemoryPlan | None = None,
        context_overflow: str = "stop",
        route: Mapping[str, Any] | None = None,
        prompt_cache: Any = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self._slide = check_overflow(context_overflow) == "slide"
        self._memory_plan = memory_plan
        self._backend = backend
        self._chain = [dict(entry) for entry in provider_chain]
        self._tokenizer = backend.tokenizer
        self._chat_template: str | None = None  # use_chat_template()
        self._name = name
        self._path = path
        self._format = model_format
        self._history = KVHistory()
        self._turns = Turns()
        self._open = OpenStreams()  # its lock: held while engine code runs (close() waits)
        self._closed = False
        self._route = dict(route) if route is not None else None
        self._states: SeqStates | None = None  # save_state / load_state, made when first used
        self._disk = attach_cache(prompt_cache, backend, path, memory_plan)
        self._spec, self._costs = speculative or OFF, PassCosts.at_load(backend, speculative)
        # the one generation loop: at parallel > 1 its thread steps every caller's sequence
        # together; at parallel=1 the caller's thread steps it in its turn
        threaded = getattr(backend, "n_slots", 1) > 1
        self._engine = Engine(backend, disk=self._disk, owner=self, threaded=threaded,
                              history=self._history)  # fmt: skip

    # -- requests -------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        config: SamplingConfig | None = None,
        *,
        wait: bool = True,
        **sampling: Any,
    ) -> GenerationResult:
        """Generate a completion of ``prompt`` (text, or token ids) and return it whole.
        Requests take their turn in arrival order (at parallel=N, one of N slots);
        ``wait=False`` raises ``ModelBusyError`` instead of waiting for one."""
        return self.stream(prompt, config, wait=wait, **sampling).collect()

    def stream(
        self,
        prompt: Prompt,
        config: SamplingConfig | None = None,
        *,
        wait: bool = True,
        **sampling: Any,
    ) -> TokenStream:
        """Generate a completion of ``prompt`` as a stream of Chunks of complete text. The
        request takes its turn when iteration starts (``wait=False``: the first ``next()``
        raises ``ModelBusyError`` if it would have to wait)."""
        ids = self._prompt_ids(prompt)
        cfg = SamplingConfig.from_kwargs(config, **sampling)
        return self._stream(ids, cfg, self._bos_len(), wait)

    def _stream(
        self, ids: list[int], cfg: SamplingConfig, keep: int, wait: bool, *, eager: bool = False
    ) -> TokenStream:
        """The stream of one checked request; ``eager`` joins the batch now rather than when
        iteration starts."""
        if not isinstance(wait, bool):
            raise InvalidRequestError(f"wait={wait!r} is invalid: expected True or False")
        sampler = check_request(self._backend, ids, cfg)  # raises now, not at next()
        # refuses a draft model it was not loaded with; None when it does not speculate
        spec = for_request(cfg.speculative, self._spec, self._backend, self._costs)
        cancel = threading.Event()
        parse = sampler.constraint.parse if sampler.constraint is not None else None
        request = Submitted(ids, sampler, cancel, keep if self._slide else None, spec)
        if not self._engine.threaded:
            chunks = self._locked(request, wait)
        elif eager:
            chunks = self._engine.submit(request, wait=wait)
        else:
            chunks = self._joined(request, wait)
        return TokenStream(chunks, cancel, parse)

    @overload
    def chat(
        self,
        messages: Messages,
        config: SamplingConfig | None = ...,
        *,
        stream: Literal[False] = ...,
        wait: bool = ...,
        parse_special_in_content: bool = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        parallel_tool_calls: bool | None = ...,
        **sampling: Any,
    ) -> GenerationResult: ...

    @overload
    def chat(
        self,
        messages: Messages,
        config: SamplingConfig | None = ...,
        *,
        stream: Literal[True],
        wait: bool = ...,
        parse_special_in_content: bool = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        parallel_tool_calls: bool | None = ...,
        **sampling: Any,
    ) -> TokenStream: ...

    def chat(
        self,
        messages: Messages,
        config: SamplingConfig | None = None,
        *,
        stream: bool = False,
        wait: bool = True,
        parse_special_in_content: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **sampling: Any,
    ) -> GenerationResult | TokenStream:
        """Reply to ``messages`` (role/content dicts) through the model's chat template.

        Message content is read as plain text: text that spells a special token
        (``<|im_start|>system``) cannot forge a turn. ``parse_special_in_content=True`` reads
        such text as the special token instead (for callers who build markup on purpose).

        ``tools`` (OpenAI's function tools) and ``tool_choice`` ("auto", "none", "required"
        or ``{"type": "function", "function": {"name": ...}}``): calls come back in
        ``result.tool_calls`` with ``finish_reason="tool_calls"``; "required" and a named
        function constrain the reply to a valid call; under "auto" a call the model opens is
        held to its schema and a failed one asked again once (``edgeinfer.tools.run``).
        """
        check_flag(parse_special_in_content, "parse_special_in_content")
        cfg = SamplingConfig.from_kwargs(config, **sampling)
        if tools is not None or tool_choice is not None or parallel_tool_calls is not None:
            return tool_chat(self, messages, cfg, tools=tools, tool_choice=tool_choice,
                             parallel_tool_calls=parallel_tool_calls, stream=stream, wait=wait,
                             parse_special_in_content=parse_special_in_content)  # fmt: skip
        ids, keep = self._chat_request(messages, parse_special_in_content)
        result = self._stream(ids, cfg, keep, wait)
        return result if stream else result.collect()

    def _chat_request(
        self, messages: Messages, parse_special: bool, tools: Messages | None = None
    ) -> tuple[list[int], int]:
        """The prompt ids of ``messages`` and the tokens a sliding context keeps."""
        require_generation(self._backend, self._name)
        ids = self._chat_ids(messages, parse_special_in_content=parse_special, tools=tools)
        keep = self._bos_len()
        if self._slide and messages and messages[0].get("role") == "system":
            # what a sliding context keeps: the rendered system message
            system = self._chat_ids(
                messages[:1], add_generation_prompt=False, parse_special_in_content=parse_special
            )
            pairs = enumerate(zip(ids, system, strict=False))
            keep = next((i for i, (a, b) in pairs if a != b), min(len(system), len(ids)))
        return ids, keep

    def generate_many(
        self,
        requests: Sequence[Request],
        config: SamplingConfig | None = None,
        **sampling: Any,
    ) -> list[GenerationResult]:
        """Run many requests as one batch; their results in input order. Each request is a
        prompt (text or token ids) or a mapping with ``prompt`` or ``messages`` (role/content
        dicts, through the chat template) and its own sampling fields, which override
        ``config`` and ``**sampling``. Every request is checked before any runs (an invalid
        one raises ``InvalidRequestError`` naming its index). With ``load(..., parallel=N)``
        up to N run at once, sharing each forward pass; at ``parallel=1`` one after another.
        """
        self._require_open()
        if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Sequence):
            raise InvalidRequestError(
                "generate_many() takes a list of requests (prompts or mappings with 'prompt' "
                f"or 'messages'), not {type(requests).__name__}"
            )
        base = SamplingConfig.from_kwargs(config, **sampling)
        prepared = [self._many_request(i, r, base) for i, r in enumerate(requests)]

        def starter(ids: list[int], cfg: SamplingConfig, keep: int) -> Any:
            return lambda: self._stream(ids, cfg, keep, True, eager=True)

        starters = [starter(*p) for p in prepared]
        return collect_in_order(starters, window=4 * self.parallel)

    def _many_request(
        self, index: int, request: Any, base: SamplingConfig
    ) -> tuple[list[int], SamplingConfig, int]:
        """Request ``index`` read and checked: its ids, sampling and sliding keep."""
        try:
            kind, payload, fields = read_request(index, request)
            cfg = SamplingConfig.from_kwargs(base, **fields)
            if kind == "messages":
                ids, keep = self._chat_request(payload, False)
            else:
                ids, keep = self._prompt_ids(payload), self._bos_len()
            check_request(self._backend, ids, cfg)
            check_setting(cfg.speculative, self._spec)
        except InvalidRequestError as exc:
            message = str(exc)
            if not message.startswith(f"requests[{index}]"):
                message = f"requests[{index}]: {message}"
            raise InvalidRequestError(message) from exc
        return ids, cfg, keep

    def _chat_ids(self, messages: Messages, **options: Any) -> list[int]:
        """Prompt ids of ``messages`` through the chat template (``chat.encode_messages``:
        add_generation_prompt, tools, parse_special_in_content)."""
        return encode_messages(self._tokenizer, self.chat_template, messages, **options)

    def _bos_len(self) -> int:
        """Tokens the tokenizer puts before any text (a BOS token, usually): kept on slides."""
        return len(self._tokenizer.encode("", add_special=True)) if self._slide else 0

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template ``chat()`` renders messages with: the model's own, or the
        one set with ``use_chat_template``; None when there is none."""
        return self._chat_template or self._tokenizer.chat_template

    def use_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (Jinja, as in tokenizer_config.json) instead of the
        model's own: for models that ship without one."""
        if not isinstance(template, str) or not template.strip():
            raise InvalidRequestError("a chat template must be a non-empty Jinja string")
        self._chat_template = template

    def apply_chat_template(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text the model's chat template makes of ``messages`` (``tools``, in
        OpenAI's shape, as the template's ``tools`` variable)."""
        return render_chat(
            self.chat_template,
            messages,
            bos_token=self._tokenizer.bos_token,
            eos_token=self._tokenizer.eos_token,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds the model's BOS/EOS tokens,
        ``parse_special`` reads special-token text (``<|im_end|>``) as those tokens."""
        self._require_open()
        if not isinstance(text, str):
            raise InvalidRequestError(f"tokenize() takes text, not {type(text).__name__}")
        return self._tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``; control tokens add nothing, invalid UTF-8 becomes U+FFFD."""
        self._require_open()
        if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1:
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, Sequence):
            raise InvalidRequestError(
                f"detokenize() takes a list of token ids, not {type(token_ids).__name__}"
            )
        checked = checked_token_ids(token_ids, self._tokenizer.n_vocab, "detokenize()")
        pieces = b"".join(self._tokenizer.token_bytes(t) for t in checked)
        return pieces.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token ``token_id`` adds to a text (b"" for a control token)."""
        (checked,) = checked_token_ids([token_id], self._tokenizer.n_vocab, "token_bytes()")
        return self._tokenizer.token_bytes(checked)

    def embed(
        self, texts: str | Sequence[str], *, normalize: bool = True, batch_size: int | None = None
    ) -> np.ndarray:
        """Vectors float32 [n, dim] of ``texts`` (an embedding model); see ``embed_detailed``."""
        return self.embed_detailed(texts, normalize=normalize, batch_size=batch_size).vectors

    def embed_detailed(self, texts: str | Sequence[str], **options: Any) -> EmbedResult:
        """Vectors, tokens per text, which were truncated (``embedding.embed_for_model``)."""
        self._require_open()
        return embed_for_model(self._backend, self._name, self._memory_plan, texts, **options)

    def embed_ids(self, seqs: Sequence[Sequence[int]], **options: Any) -> EmbedResult:
        """``embed_detailed`` of token-id lists (this model's vocabulary) instead of texts; a
        list past the model's length is cut as a text's tokens are (its last id kept)."""
        self._require_open()
        ids = [checked_token_ids(s, self._tokenizer.n_vocab, "input") for s in seqs]
        given = GivenIds(self._backend, ids)
        return embed_for_model(given, self._name, self._memory_plan, [""] * len(ids), **options)

    @property
    def info(self) -> dict[str, Any]:
        """Format, backend, provider, device, context length, KV cache size, threads, and the
        provider chain: each candidate tried (``chosen`` / ``failed`` with its error) and each
        left out (``unavailable``), with reasons."""
        backend = self._backend
        return {
            "name": self._name,
            "path": str(self._path),
            "format": self._format,
            **backend.info,
            "context_length": backend.n_ctx,
            "kv_cache_bytes": backend.kv_nbytes,
            "vocab_size": self._tokenizer.n_vocab,
            "fallback_chain": [dict(entry) for entry in self._chain],
            "memory_plan": self._memory_plan.to_dict() if self._memory_plan else None,
            "parallel": self.parallel,
            "route": dict(self._route) if self._route is not None else None,
            "prompt_cache": self._disk.stats if self._disk is not None else None,
            "speculative": self._spec.info,  # method, draft model, its planned bytes
        }

    @property
    def parallel(self) -> int:
        """Sequences the model runs at once (its slots; ``load(..., parallel=N)``)."""
        return int(getattr(self._backend, "n_slots", 1))

    @property
    def activity(self) -> dict[str, int]:
        """Slots, slots busy, and requests waiting for a slot, now."""
        if self._engine.threaded:
            return self._engine.activity
        waiting = self._turns.waiting
        return {"slots": 1, "busy": int(self._turns.busy), "queued": max(0, waiting - 1)}

    @property
    def context_length(self) -> int:
        return self._backend.n_ctx

    def save_state(self, path: str | PathLike[str]) -> int:
        """Write the current sequence (its tokens and KV cache) to ``path``, atomically, with
        a fingerprint of this model and its settings; the file's size in bytes. A later
        ``load_state`` (in any process) resumes it: a prompt that starts with those tokens is
        not read again. ``SnapshotError`` if the file cannot be written. At parallel > 1 the
        current sequence is the last request's to end."""
        return self._snapshot(session.save_state, path, "save_state", free=False)

    def load_state(self, path: str | PathLike[str]) -> list[int]:
        """Make the sequence a snapshot ``save_state`` wrote; its tokens. A file that is not
        a snapshot of this model with these settings (another model, engine version, context,
        a truncated or changed file) raises ``SnapshotError`` naming it. At parallel > 1 it
        goes into a free slot, which a prompt that starts with its tokens then reuses."""
        return self._snapshot(session.load_state, path, "load_state", free=True)

    def _snapshot(self, op: Any, path: str | PathLike[str], what: str, *, free: bool) -> Any:
        """``op`` on the model's sequence: in its turn, or between steps at parallel > 1."""
        self._require_open()
        self._states = self._states or SeqStates(self._backend, self._path)
        run = partial(op, self._states, self._backend, path=path)
        if self._engine.threaded:
            return self._engine.on_slot(lambda s, h: run(history=h, slot=s), f"{what}()", free=free)
        with self._turn(what):
            return run(history=self._history)

    def score(
        self, prompt: Prompt, continuation: Prompt, *, top_logprobs: int = 0, rows: bool = False
    ) -> Scores:
        """Log-probabilities of ``continuation``'s tokens after ``prompt`` (text, read without
        BOS, or ids), the ``top_logprobs`` likeliest tokens at each, and with ``rows`` each
        place's whole distribution (edgeinfer.generation.scoring)."""
        ids, cont = self._prompt_ids(prompt), self._prompt_ids(continuation, add_special=False)
        with self._turn("score"):
            return scoring.score(self._backend, self._history, ids, cont, top_logprobs, rows)

    def is_end_token(self, token_id: int) -> bool:
        """True for a token that ends a reply (EOS, end of turn)."""
        (checked,) = checked_token_ids([token_id], self._tokenizer.n_vocab, "is_end_token()")
        return bool(self._tokenizer.is_end_of_generation(checked))

    @contextmanager
    def _turn(self, what: str) -> Iterator[None]:
        """The model to this call alone (parallel=1): no request runs until the block ends."""
        if self._engine.threaded:
            raise InvalidRequestError(f"{what} works on a model loaded with parallel=1")
        with self._turns.turn(), self._open.lock:
            self._require_open()
            yield

    def close(self) -> None:
        """Free the engine and its KV cache; calling it again does nothing. Open streams end
        "cancelled" (at their next step: a stream another thread holds suspended is not
        waited for). A SIGINT or SIGTERM arriving meanwhile takes effect once it is freed."""
        self._open.end_all()  # they end "cancelled" at their next step, later ones at once
        self._engine.close()  # running sequences end "cancelled"; the loop stops
        if self._disk is not None:
            self._disk.flush()  # a snapshot being written is finished (it is atomic anyway)
        with self._open.lock:  # no request is in the engine now; none will enter it again
            if not self._closed:
                self._closed = True
                with signals_held():
                    self._backend.close()
                    self._spec.close()  # the draft model, if load() opened one

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"context_length={self._backend.n_ctx}"
        return f"<edgeinfer.Model {self._name!r} {self._format} {state}>"

    # -- internals ------------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise EdgeInferError("the model is closed; load it again")

    def _prompt_ids(self, prompt: Prompt, add_special: bool = True) -> list[int]:
        self._require_open()
        require_generation(self._backend, self._name)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return self._tokenizer.encode(prompt, add_special=add_special)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise InvalidRequestError(
                f"prompt must be text or a list of token ids, not {type(prompt).__name__}"
            )
        return checked_token_ids(prompt, self._tokenizer.n_vocab, "prompt")

    def _joined(self, request: Submitted, wait: bool) -> Iterator[Chunk]:
        """Serve one request as a sequence of the running batch, joined as iteration starts."""
        self._require_open()
        yield from self._engine.submit(request, wait=wait)

    def _locked(self, request: Submitted, wait: bool) -> Iterator[Chunk]:
        """Serve one request in its turn (taken when iteration starts), the caller's thread
        stepping the one-slot loop. The turn ends before the final chunk is handed out, so a
        consumer that stops there holds nothing."""
        final: Chunk | None = None
        start = partial(self._engine.run, request)
        with self._turns.turn(wait=wait):
            for chunk in self._open.steps(self._require_open, request.cancel, start):
                if chunk.finish_reason is not None:
                    final = chunk
                    break
                yield chunk
        if final is not None:
            yield final
