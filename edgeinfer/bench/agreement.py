"""Fidelity beside speed (``edgeinfer bench --agreement``): how far each engine's answers lie
from a reference on the same prompts, so a faster row also shows what its speed cost.

The reference is llama.cpp on the source GGUF, computed in the same run. On each of the
conversion check's prompts (the same token ids for every engine) it gives its greedy
continuation and its next-token logits along it; each engine is then teacher-forced along
that continuation (top-1 agreement, the decisive top-1 beyond near-ties, mean KL) and lets
generate greedily on its own (the greedy prefix: tokens reproduced before the first
divergence). The figures are ``converters.validate``'s, so a bench row and a conversion
report say the same thing.

Everything runs in one fresh process per model (``python -m edgeinfer.bench.agreement``,
the spec on stdin, one marked result line out), the engines one after the other beside the
reference.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..bounded_json import parse_json
from ..errors import EdgeInferError
from .records import BenchResultError, check_agreement, one_line

__all__ = [
    "AGREEMENT_TOKENS",
    "add_agreement",
    "figures_of",
    "measure_agreement",
    "notes_of",
    "reference_for",
    "tag_bars",
]

RESULT_MARK = "edgeinfer-agreement-result "
AGREEMENT_TOKENS = 16  # greedy tokens per prompt, as the conversion check
CONTEXT = 256
MAX_LINE_BYTES = 2**20
WORKER = (sys.executable, "-m", "edgeinfer.bench.agreement")

Spec = dict[str, Any]
Forced = tuple[np.ndarray, list[int]]  # teacher-forced logits [positions, vocab], own greedy


def reference_for(model: str, given: Path | None) -> Path | None:
    """The GGUF to judge ``model``'s rows against: ``given`` (--reference FILE.gguf), else the
    model itself when it is a GGUF (a catalog name's file); None when there is none."""
    from ..loader import resolve

    if given:
        return Path(given).expanduser()
    source = resolve(model)
    return Path(source.path) if source.format == "gguf" else None


def measure_agreement(spec: Spec, timeout_s: float) -> dict[str, Any]:
    """Run ``spec`` ({"reference", "threads", "engines": [{"engine", "model", "engine_model",
    "route"?}]}) in a fresh process: the reference and one record per engine, checked.
    BenchResultError when the process fails as a whole (the reference does not load, a crash,
    a timeout)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.run(
                WORKER,
                input=json.dumps(spec).encode("utf-8"),
                stdout=out,
                stderr=err,
                timeout=timeout_s,
                start_new_session=True,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BenchResultError(
                f"the agreement run took longer than {timeout_s:g} s and was stopped"
            ) from None
        out.seek(0)
        lines = out.read(MAX_LINE_BYTES * 2).split(b"\n")
        err.seek(0)
        tail = err.read()[-4096:].decode("utf-8", "replace").strip().splitlines()[-1:]
    mark = RESULT_MARK.encode("utf-8")
    for line in reversed(lines):
        if line.startswith(mark):
            record = parse_json(
                line[len(mark) :],
                what="the agreement result line",
                error=BenchResultError,
                max_bytes=MAX_LINE_BYTES,
            )
            return check_agreement(record, "the agreement result")
    why = one_line(tail[0]) if tail else f"status {proc.returncode}"
    raise BenchResultError(f"the agreement run ended without a result: {why}")


def add_agreement(
    report: Any, models: Sequence[str], reference: Path | None, *, route: str, timeout_s: float
) -> None:
    """Measure the agreement of every engine row of ``report`` (one fresh process per model)
    and keep it in ``report.agreement``; what could not be measured becomes a note."""
    from ..loader import resolve
    from .peers import as_named

    measured = report.measured()
    if not measured:
        return
    threads = min(r.threads for r in measured)
    engines: list[dict[str, Any]] = []
    references: list[str] = []
    prompts = 0
    for given in models:
        source = resolve(given)
        rows = [r for r in measured if r.model_path == str(source.path)]
        ref = reference_for(given, reference) if rows else None
        if rows and ref is None:
            report.notes.append(
                f"agreement: no GGUF to judge {source.name} against; name one with "
                "--reference FILE.gguf"
            )
        if ref is None:
            continue
        pairs = dict.fromkeys((r.engine, r.engine_model) for r in rows)
        spec = {
            "reference": str(ref),
            "threads": threads,
            "engines": [
                {"engine": e, "engine_model": m, "route": route if route != "auto" else None,
                 "model": as_named(given, source.path) if e == "edgeinfer" else m}
                for e, m in pairs
            ],
        }  # fmt: skip
        try:
            got = measure_agreement(spec, timeout_s * (len(pairs) + 1))
        except BenchResultError as exc:
            report.notes.append(f"agreement not measured for {source.name}: {exc}")
            continue
        engines += got["engines"]
        references.append(Path(got["reference"]).name)
        prompts = got["prompts"]
    if references:
        report.agreement = {"reference": ", ".join(references), "prompts": prompts,
                            "engines": engines}  # fmt: skip


# ---- in the report -------------------------------------------------------------------------

# what a result row carries of its engine's record
ROW_KEYS = ("top1_agreement", "decisive_top1_agreement", "mean_greedy_prefix",
            "greedy_agreement", "greedy_agreement_beyond_ties", "mean_kl")  # fmt: skip


def figures_of(agreement: dict[str, Any], row: Any) -> dict[str, Any] | None:
    """The figures of ``row``'s engine on its model, or None: an edgeinfer row only takes
    figures measured on the route (provider) it ran."""
    for e in agreement.get("engines", ()):
        same = (e["engine"], e["engine_model"]) == (row.engine, row.engine_model)
        route = row.engine != "edgeinfer" or e.get("provider") == row.last("provider")
        if same and route and "error" not in e:
            return {k: e[k] for k in ROW_KEYS}
    return None


def notes_of(agreement: dict[str, Any]) -> list[str]:
    """What the two columns mean, and each engine the agreement could not be measured for."""
    lines = [
        f"top-1 vs ref: teacher-forced top-1 agreement with {agreement['reference']} through "
        f"llama.cpp on {agreement['prompts']} prompts, measured in this run; greedy prefix: "
        f"mean tokens (of {AGREEMENT_TOKENS}) generated before the first divergence"
    ]
    for e in agreement["engines"]:
        if "error" in e:
            lines.append(f"agreement not measured for {e['engine']}: {e['error']}")
    return lines


def tag_bars(ax: Any, heights: list[float], tags: list[dict[str, Any] | None]) -> None:
    """Each decode bar's top-1 agreement with the reference, written above the bar."""
    for x, (height, tag) in enumerate(zip(heights, tags, strict=True)):
        if tag is not None:
            ax.annotate(f"top-1 {tag['top1_agreement']:.1%}", (x, height), ha="center",
                        va="bottom", fontsize="x-small", rotation=90, xytext=(0, 3),
                        textcoords="offset points")  # fmt: skip


# ---- in the fresh process ------------------------------------------------------------------


def _reference_runs(spec: Spec) -> tuple[list[list[int]], list[Forced]]:
    """The prompts' ids and, per prompt, llama.cpp's logits along its greedy continuation and
    that continuation."""
    from ..converters.validate import VALIDATION_PROMPTS, teacher_forced
    from ..loader import load

    with load(
        spec["reference"],
        device="cpu",
        context_length=CONTEXT,
        threads=spec["threads"],
        engine="llama.cpp",
    ) as ref:
        eos = ref.is_end_token
        prompts = [list(ref.tokenize(p)) for p in VALIDATION_PROMPTS]
        runs = []
        for ids in prompts:
            result = ref.generate(ids, max_new_tokens=AGREEMENT_TOKENS, temperature=0)
            continuation = _until(list(result.token_ids), eos)
            runs.append((teacher_forced(ref, ids, continuation[:-1]), continuation))
    return prompts, runs


def _edgeinfer(spec: Spec, engine: Spec, prompts: list[list[int]], forced: list[list[int]]) -> Any:
    from ..converters.validate import teacher_forced
    from ..loader import load

    route = {"engine": engine["route"]} if engine.get("route") else {}
    with load(
        engine["model"], device="cpu", context_length=CONTEXT, threads=spec["threads"], **route
    ) as model:
        out = []
        for ids, f in zip(prompts, forced, strict=True):
            greedy = model.generate(ids, max_new_tokens=max(len(f), 1), temperature=0)
            out.append((teacher_forced(model, ids, f[:-1]), list(greedy.token_ids)))
        return out, str(model.info["provider"])


def _llama_cpp_python(
    spec: Spec, engine: Spec, prompts: list[list[int]], forced: list[list[int]]
) -> Any:
    from .peers import policy_llama

    threads = spec["threads"]
    llm = policy_llama(engine["model"], n_ctx=CONTEXT, n_threads=threads,
                       n_threads_batch=threads, logits_all=True, verbose=False)  # fmt: skip
    try:
        out = []
        for ids, f in zip(prompts, forced, strict=True):
            llm.reset()
            llm.eval(ids + f[:-1])
            logits = np.array(llm.scores[len(ids) - 1 : len(ids) + len(f[:-1])], np.float32)
            llm.reset()
            greedy = []
            for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                if len(greedy) >= len(f) or llm.token_eos() == token:
                    break
                greedy.append(int(token))
            out.append((logits, greedy))
        return out, "llama.cpp:CPU"
    finally:
        llm.close()


def _genai(spec: Spec, engine: Spec, prompts: list[list[int]], forced: list[list[int]]) -> Any:
    import onnxruntime_genai as og

    config = og.Config(engine["model"])
    options = {"intra_op_num_threads": spec["threads"], "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    config.clear_providers()
    model = og.Model(config)

    def generator(length: int) -> Any:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=length, batch_size=1)
        return og.Generator(model, params)

    out = []
    for ids, f in zip(prompts, forced, strict=True):
        g = generator(len(ids) + len(f) + 1)
        g.append_tokens(ids)
        rows = [_last_row(g.get_logits())]
        for token in f[:-1]:
            g.append_tokens([token])
            rows.append(_last_row(g.get_logits()))
        g = generator(len(ids) + len(f))
        g.append_tokens(ids)
        greedy: list[int] = []
        while not g.is_done() and len(greedy) < len(f):
            g.generate_next_token()
            greedy.append(int(g.get_next_tokens()[0]))
        out.append((np.stack(rows), greedy))
    return out, "onnxruntime-genai:cpu"


def _optimum(spec: Spec, engine: Spec, prompts: list[list[int]], forced: list[list[int]]) -> Any:
    """optimum's ``ORTModelForCausalLM`` on its export: one forward over prompt and
    continuation for the teacher-forced rows, its own ``generate`` for the greedy prefix."""
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    options = ort.SessionOptions()
    options.intra_op_num_threads = spec["threads"]
    options.inter_op_num_threads = 1
    torch.set_num_threads(spec["threads"])
    model = ORTModelForCausalLM.from_pretrained(
        engine["model"], session_options=options, provider="CPUExecutionProvider"
    )
    out = []
    with torch.no_grad():
        for ids, f in zip(prompts, forced, strict=True):
            tokens = torch.tensor([ids + f[:-1]])
            logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
            rows = np.asarray(logits[0, len(ids) - 1 :], dtype=np.float32)
            prompt = torch.tensor([ids])
            generated = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=max(len(f), 1),
                do_sample=False,
                pad_token_id=0,
            )
            out.append((rows, [int(t) for t in generated[0, len(ids) :]]))
    return out, "CPUExecutionProvider"


def _last_row(logits: Any) -> np.ndarray:
    array = np.asarray(logits, dtype=np.float32)
    return array.reshape(-1, array.shape[-1])[-1]


ENGINES: dict[str, Callable[..., Any]] = {
    "edgeinfer": _edgeinfer,
    "llama-cpp-python": _llama_cpp_python,
    "onnxruntime-genai": _genai,
    "optimum": _optimum,
}


def _until(tokens: list[int], is_eos: Any) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if is_eos(t)), tokens)


def _one_engine(
    spec: Spec, engine: Spec, prompts: list[list[int]], reference: list[Forced]
) -> dict[str, Any]:
    from ..converters.validate import agreement, position_figures

    head = {"engine": engine["engine"], "engine_model": engine.get("engine_model", engine["model"])}
    run = ENGINES.get(engine["engine"])
    if run is None:
        return {**head, "error": f"no agreement run for {engine['engine']} yet"}
    try:
        results, provider = run(spec, engine, prompts, [c for _, c in reference])
        rows = []
        for (src, continuation), (res, greedy) in zip(reference, results, strict=True):
            if res.shape != src.shape:
                raise ValueError(f"logits of shape {res.shape}, the reference's {src.shape}")
            rows.append(position_figures(src, res, continuation, greedy))
    except Exception as exc:  # an engine's own failure: this row says so, the others go on
        return {**head, "error": one_line(f"{type(exc).__name__}: {exc}")}
    return {**head, "provider": provider, **agreement(rows)}


def main() -> int:
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.ERROR)
    spec = json.loads(sys.stdin.read())
    try:
        prompts, reference = _reference_runs(spec)
    except EdgeInferError as exc:
        print(f"edgeinfer: the reference {spec['reference']} does not load: {exc}", file=sys.stderr)
        return 1
    records = [_one_engine(spec, e, prompts, reference) for e in spec["engines"]]
    line = {"reference": str(spec["reference"]), "prompts": len(prompts), "engines": records}
    sys.stdout.write(RESULT_MARK + json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
