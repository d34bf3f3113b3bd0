"""Structured output on the default model: decode speed with and without a JSON schema, and
the grammar engines' cost per token.

1. Decode tok/s of the same chat request, greedy, constrained by a JSON schema and not
   (the unconstrained run generates as many tokens, end of generation banned); 5 rounds,
   alternating, medians.
2. Mask cost per token along the constrained reply's tokens: llguidance (the engine
   edgeinfer uses: mask computation plus applying it to the logits as the generator does),
   and outlines-core for comparison (its index built from the schema's regex over the same
   vocabulary; the build time is reported too).

    python benchmarks/bench_structured.py [--rounds 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
MESSAGES = [
    {
        "role": "user",
        "content": "Alice Martin is a 34-year-old engineer from Lyon who knows Python, Rust "
        "and SQL. Extract her record as JSON.",
    }
]


def _llguidance_cost(model: Any, tokens: list[int]) -> dict[str, float]:
    from edgeinfer.generation.structured import compile_constraint

    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    t0 = time.perf_counter()
    constraint = compile_constraint(fmt, model._backend.tokenizer)
    compile_ms = (time.perf_counter() - t0) * 1000
    logits = np.zeros(model._backend.tokenizer.n_vocab, np.float32)
    times = []
    for token in tokens:
        t = time.perf_counter()
        constraint.mask(logits)
        times.append(time.perf_counter() - t)
        constraint.accept(token)
    return {"compile_ms": compile_ms, "mask_us_median": statistics.median(times) * 1e6,
            "mask_us_mean": statistics.mean(times) * 1e6}  # fmt: skip


def _outlines_cost(model: Any, tokens: list[int]) -> dict[str, Any]:
    try:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return {"skipped": "outlines-core is not installed"}
    tok = model._backend.tokenizer
    eos = next(i for i in range(tok.n_vocab) if tok.is_end_of_generation(i))
    pieces: dict[bytes, list[int]] = {}
    for i in range(tok.n_vocab):
        piece = tok.token_bytes(i)
        if piece and i != eos:
            pieces.setdefault(piece, []).append(i)
    t0 = time.perf_counter()
    vocabulary = oc.Vocabulary(eos, pieces)
    # the same whitespace freedom as llguidance's JSON grammar (newlines and indentation)
    regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[\n ]*")
    index = oc.Index(regex, vocabulary)
    build_ms = (time.perf_counter() - t0) * 1000
    guide = oc.Guide(index)
    mask = np.zeros((tok.n_vocab + 31) // 32, dtype=np.int32)
    times = []
    followed = 0
    for token in tokens:
        t = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        times.append(time.perf_counter() - t)
        try:
            guide.advance(token)
        except Exception:  # outlines' regex whitespace differs from llguidance's grammar
            break
        followed += 1
    return {"build_ms": build_ms, "mask_us_median": statistics.median(times) * 1e6,
            "tokens_followed": followed}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "structured.json"
    )
    args = parser.parse_args()
    import edgeinfer
    from edgeinfer.files import catalog

    gguf = catalog.fetch(catalog.DEFAULT_MODEL)
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    with edgeinfer.load(gguf, context_length=1024, threads=args.threads) as model:
        first = model.chat(MESSAGES, temperature=0, max_new_tokens=300, response_format=fmt)
        n = len(first.token_ids)
        ban = {i: float("-inf") for i in range(model._backend.tokenizer.n_vocab)
               if model._backend.tokenizer.is_end_of_generation(i)}  # fmt: skip
        free: list[float] = []
        constrained: list[float] = []
        for _ in range(args.rounds):
            r = model.chat(MESSAGES, temperature=0, max_new_tokens=300, response_format=fmt)
            constrained.append(r.stats.decode_tokens_per_s)
            r = model.chat(MESSAGES, temperature=0, max_new_tokens=n, logit_bias=ban)
            free.append(r.stats.decode_tokens_per_s)
        report = {
            "model": catalog.DEFAULT_MODEL,
            "threads": args.threads,
            "reply": first.text,
            "reply_tokens": n,
            "parsed": first.parsed,
            "decode_tok_s_unconstrained": free,
            "decode_tok_s_constrained": constrained,
            "ratio": statistics.median(constrained) / statistics.median(free),
            "llguidance": _llguidance_cost(model, list(first.token_ids)),
            "outlines_core": _outlines_cost(model, list(first.token_ids)),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "reply"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
