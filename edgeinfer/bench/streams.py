"""Runs with many streams at once (``edgeinfer bench --parallel N``), inside the worker's
fresh process.

A run has two parts, on one loaded model:

1. **Together**: N requests (the same prompt length, other tokens each) are handed over at
   the same moment from N threads; each token is stamped as its stream hands it back. This
   gives the aggregate decode rate, each stream's own rate and the TTFT of every request.
2. **Joining**: N - 1 requests run; once every one of them is decoding, one more request of
   the same length arrives, and its time to first token is taken; then the others are
   cancelled. At N = 1 the request is alone: the reference for the others.

onnxruntime-genai's ``og.Engine`` runs the same two parts through its own request API.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .workload import end_of_generation_ids, prompt_ids

__all__ = ["parallel_figures", "percentile", "run_edgeinfer_parallel", "run_genai_engine"]

Spec = dict[str, Any]
JOIN_WAIT_S = 600.0  # the longest the joining part waits for the running streams
MIN_SPAN_S = 1e-9  # a span shorter than the clock's step is no measurement: its rate is 0


def _rate(count: float, span: float) -> float:
    """``count`` per second over ``span``; 0 over a span no clock can measure (two stamps a
    rounding apart would otherwise give a rate beyond any machine's)."""
    return count / span if span >= MIN_SPAN_S else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolated between the nearest ranks."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _stream_figures(t0: float, stamps: list[float]) -> dict[str, float]:
    n = len(stamps)
    span = stamps[-1] - stamps[0] if n else 0.0
    return {
        "tokens": n,
        "ttft_s": stamps[0] - t0 if n else 0.0,
        "decode_tok_s": _rate(n - 1, span) if n > 1 else 0.0,
    }


def parallel_figures(
    starts: Sequence[float], stamps: Sequence[list[float]], n_prompt: int
) -> dict[str, Any]:
    """The figures of the streams run together: one start time and the token stamps of
    each stream.

    ``decode_tok_s`` (aggregate) is every stream's decode tokens over the span from the
    first stream's first token to the last stream's last one, so a late prefill counts
    against it; ``steady_decode_tok_s`` counts only the span when every stream was decoding.
    """
    streams = [_stream_figures(t0, s) for t0, s in zip(starts, stamps, strict=True)]
    live = [s for s in stamps if s]
    ttfts = [f["ttft_s"] for f, s in zip(streams, stamps, strict=True) if s]
    out: dict[str, Any] = {
        "parallel": len(streams),
        "tokens": sum(f["tokens"] for f in streams),
        "ttft_s": percentile(ttfts, 0.5),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "prefill_tok_s": 0.0,
        "decode_tok_s": 0.0,
        "steady_decode_tok_s": 0.0,
        "per_stream_decode_tok_s": (
            sum(f["decode_tok_s"] for f in streams) / len(streams) if streams else 0.0
        ),
        "streams": streams,
    }
    if not live:
        return out
    first_token_done = max(s[0] for s in live) - min(starts)
    if first_token_done >= MIN_SPAN_S:  # else no rate: the key is left out
        out["prefill_tok_s"] = n_prompt * len(live) / first_token_done
    span = max(s[-1] for s in live) - min(s[0] for s in live)
    decoded = sum(len(s) - 1 for s in live)
    out["decode_tok_s"] = _rate(decoded, span)
    out["steady_decode_tok_s"] = _steady(live)
    return out


def _steady(live: Sequence[list[float]]) -> float:
    """Decode tokens/s while every stream was decoding (from the last first token to the
    first last token); 0 when that span is empty."""
    begin = max(s[0] for s in live)
    end = min(s[-1] for s in live)
    if end <= begin:
        return 0.0
    steps = sum(max(0, sum(1 for t in s if begin <= t <= end) - 1) for s in live)
    return _rate(steps, end - begin)


# -- edgeinfer ------------------------------------------------------------------------------


def run_edgeinfer_parallel(spec: Spec) -> dict[str, Any]:
    """N streams through one model loaded with ``parallel=N``: together, then joining."""
    from ..loader import load

    n = spec["parallel"]
    with load(
        spec["model"],
        device=spec["device"],
        memory_budget=spec["memory_budget"],
        context_length=spec["context_length"],
        threads=spec["threads"],
        speculative=spec.get("speculative", "off"),
        parallel=n,
        **({"engine": spec["route"]} if spec.get("route") else {}),
    ) as model:
        prompts = [prompt_ids(model, spec["prompt_tokens"], variant=i) for i in range(n)]
        ban = end_of_generation_ids(model)
        bias = {t: float("-inf") for t in ban}

        def start(ids: list[int], max_new: int) -> Any:
            return model.stream(ids, max_new_tokens=max_new, temperature=0, logit_bias=bias)

        starts, stamps = _together(start, prompts, spec["new_tokens"])
        join = _joining(start, prompts, spec["new_tokens"])
        info = model.info
    plan = info.get("memory_plan") or {}
    return {
        **parallel_figures(starts, stamps, spec["prompt_tokens"]),
        "join_ttft_s": join,
        "provider": info["provider"],
        "device": info["device"],
        "n_gpu_layers": info.get("n_gpu_layers"),
        "context_length": info["context_length"],
        "plan_total_bytes": plan.get("total"),
        "prompt_ids": prompts[0],
        "ban_ids": ban,
    }


Start = Callable[[list[int], int], Any]  # (prompt ids, max new tokens) -> a TokenStream


def _threads(targets: list[Callable[[], None]]) -> list[BaseException]:
    """Run each target on its own thread, all released at once; the errors they raised."""
    errors: list[BaseException] = []
    gate = threading.Barrier(len(targets))

    def body(target: Callable[[], None]) -> None:
        try:
            gate.wait()
            target()
        except BaseException as exc:  # handed to the caller, which raises the first
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _consume(stream: Any, stamps: list[float], first: threading.Event | None = None) -> None:
    with stream:
        for chunk in stream:
            if chunk.token_ids:
                now = time.perf_counter()
                stamps.extend([now] * len(chunk.token_ids))
                if first is not None:
                    first.set()


def _together(
    start: Start, prompts: list[list[int]], new_tokens: int
) -> tuple[list[float], list[list[float]]]:
    starts = [0.0] * len(prompts)
    stamps: list[list[float]] = [[] for _ in prompts]

    def one(i: int) -> Callable[[], None]:
        def run() -> None:
            starts[i] = time.perf_counter()
            _consume(start(prompts[i], new_tokens), stamps[i])

        return run

    errors = _threads([one(i) for i in range(len(prompts))])
    if errors:
        raise errors[0]
    return starts, stamps


def _joining(start: Start, prompts: list[list[int]], new_tokens: int) -> float:
    """The time to first token of the last prompt, handed over once the others (the
    workload's requests, cancelled then) are all decoding."""
    running = [start(ids, new_tokens) for ids in prompts[:-1]]
    firsts = [threading.Event() for _ in running]
    errors: list[BaseException] = []

    def keep(stream: Any, first: threading.Event) -> None:
        try:
            _consume(stream, [], first)
        except BaseException as exc:
            errors.append(exc)
        finally:
            first.set()

    threads = [
        threading.Thread(target=keep, args=(s, f), daemon=True)
        for s, f in zip(running, firsts, strict=True)
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + JOIN_WAIT_S
        for f in firsts:
            f.wait(max(0.0, deadline - time.monotonic()))
        if errors:
            raise errors[0]
        stamps: list[float] = []
        t0 = time.perf_counter()
        _consume(start(prompts[-1], 2), stamps)
        return stamps[0] - t0 if stamps else 0.0
    finally:
        for s in running:
            s.cancel()
        for t in threads:
            t.join()


# -- onnxruntime-genai's Engine ---------------------------------------------------------------


def run_genai_engine(spec: Spec) -> dict[str, Any]:
    """onnxruntime-genai's continuous-batching ``og.Engine`` on its own folder, the same
    two parts: N requests at once, then one joining N - 1 running ones."""
    import onnxruntime_genai as og

    n, threads = spec["parallel"], spec["threads"]
    config = og.Config(spec["model"])
    config.overlay(json.dumps(_genai_overlay(threads, n, spec["context_length"])))
    config.clear_providers()  # none: the CPU
    engine = og.Engine(og.Model(config))
    ids = spec["prompt_ids"]
    prompts = [_rotated(ids, i) for i in range(n)]
    driver = _EngineDriver(og, engine, spec["new_tokens"])
    starts, stamps = driver.together(prompts)
    join = driver.joining(prompts)
    return {
        **parallel_figures(starts, stamps, len(ids)),
        "join_ttft_s": join,
        "provider": "onnxruntime-genai:cpu",
        "device": "cpu",
        "context_length": spec["context_length"],
    }


def _genai_overlay(threads: int, n: int, context: int) -> dict[str, Any]:
    options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    return {
        "model": {"context_length": context, "decoder": {"session_options": options}},
        "search": {"max_length": context},
        # the engine's slots: without this it batches at most 4 requests
        "engine": {"static_batching": {"max_batch_size": n}},
    }


def _rotated(ids: list[int], i: int) -> list[int]:
    """edgeinfer's first prompt with another start after BOS, for the i-th stream (the
    peer gets edgeinfer's ids, not its tokenizer)."""
    if i == 0 or len(ids) < 3:
        return list(ids)
    head, body = ids[:1], ids[1:]
    k = (i * 11) % len(body)
    return head + body[k:] + body[:k]


class _EngineDriver:
    """Feeds requests to an ``og.Engine`` and stamps the tokens its ``run`` hands back."""

    def __init__(self, og: Any, engine: Any, new_tokens: int) -> None:
        self._og = og
        self._engine = engine
        self._new = new_tokens
        self._buffer = engine.create_event_buffer(4096)

    def _request(self, ids: list[int], new_tokens: int) -> Any:
        import numpy as np

        request = self._engine.create_request()
        turn = self._og.TurnOptions(request)
        turn.set_do_sample(False)
        turn.set_max_generated_tokens(new_tokens)
        turn.set_min_generated_tokens(new_tokens)  # end of generation masked, as in ours
        request.begin_turn(np.asarray(ids, dtype=np.int32), turn)
        return request

    def _step(self, stamps: dict[int, list[float]], finished: set[int]) -> None:
        """One ``run`` of the engine; token and finish events filed by request."""
        flags = self._og.EngineEventFlags
        events = self._engine.run(self._buffer)
        now = time.perf_counter()
        for event in events or ():
            key = id(event.request)
            if int(event.flags) & int(flags.FAILED):
                raise RuntimeError(f"og.Engine failed a request: {event.error_code}")
            if int(event.flags) & int(flags.TOKEN):
                stamps.setdefault(key, []).append(now)
            if int(event.flags) & int(flags.TURN_FINISHED):
                finished.add(key)

    def together(self, prompts: list[list[int]]) -> tuple[list[float], list[list[float]]]:
        stamps: dict[int, list[float]] = {}
        finished: set[int] = set()
        starts, requests = [], []
        for ids in prompts:
            starts.append(time.perf_counter())
            requests.append(self._request(ids, self._new))
        while len(finished) < len(requests):
            self._step(stamps, finished)
        out = [stamps.get(id(r), []) for r in requests]
        for r in requests:
            r.close()
        return starts, out

    def joining(self, prompts: list[list[int]]) -> float:
        stamps: dict[int, list[float]] = {}
        finished: set[int] = set()
        # the running requests are the workload's; the engine may hold a new one back
        # until its batch is done (static batching), and then that time is its TTFT
        running = [self._request(ids, self._new) for ids in prompts[:-1]]
        while any(id(r) not in stamps and id(r) not in finished for r in running):
            self._step(stamps, finished)
        t0 = time.perf_counter()
        joiner = self._request(prompts[-1], 2)
        while id(joiner) not in stamps and id(joiner) not in finished:
            self._step(stamps, finished)
        ttft = stamps[id(joiner)][0] - t0 if id(joiner) in stamps else 0.0
        for r in [*running, joiner]:
            r.close()
        return ttft
