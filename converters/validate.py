"""Prove a converted model still answers like its source: every route's checks live here.

Tokenizers first: a GGUF written from a checkpoint must give ``tokenizer.json``'s ids, and the
``tokenizer.json`` written from a GGUF must give llama.cpp's, on ``TOKENIZER_CHECK_TEXT``.
Then answers: on a fixed set of prompts the source (transformers in fp32, or llama.cpp on a
GGUF) and the converted model (through edgeinfer's own runtime) are compared:
- top-1 agreement: teacher-forced along the source's greedy continuation, how often the
  result's most likely next token is the source's;
- mean KL divergence KL(source || result) of those next-token distributions;
- greedy agreement: the result's own greedy continuation against the source's, as the mean
  fraction of the source continuation reproduced before the first difference.

Two engines that round activations differently part at near-ties: where the source's two most
likely tokens are almost equally likely, either answer is right, and a flat (high-entropy) base
model has many such places. The verdict therefore uses measures that do not amplify them:
- decisive top-1 agreement: top-1 agreement over the positions where the source's most likely
  token leads its runner-up by more than ``TIE_MARGIN`` nats (log-probability);
- greedy agreement beyond ties: as greedy agreement, but a continuation whose first difference
  is a token the source rated within ``TIE_MARGIN`` of its own choice counts as reproduced
  (after a tie the two continuations legitimately differ).
The plain figures stay in the report beside them. When fewer than ``MIN_DECISIVE`` positions
are decisive (a model too flat for top-1 to say anything), the relative KL decides: the mean
KL(source || result) over the mean KL between the source's own next-token distributions at
different positions of a prompt, at most ``MAX_RELATIVE_KL`` (scale-free: a flat model's
small divergences are judged against its small spread).
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.config import LoadConfig
from edgeinfer.errors import BackendUnavailableError, ConversionError, EdgeInferError
from edgeinfer.files.manifest import Manifest
from edgeinfer.loader import llama_cpp_installed, load
from edgeinfer.machine.inventory import devices
from edgeinfer.machine.policy import plan_providers
from edgeinfer.model import Model

from .config import ConvertConfig

__all__ = [
    "MAX_RELATIVE_KL",
    "MIN_DECISIVE",
    "TIE_MARGIN",
    "TOKENIZER_CHECK_TEXT",
    "VALIDATION_PROMPTS",
    "ModelReference",
    "TransformersReference",
    "check_against_llama_cpp",
    "check_gguf_tokenizer",
    "compare",
    "open_result",
    "summary",
    "teacher_forced",
    "validate_conversion",
    "validate_gguf",
    "validate_native",
    "validate_native_checkpoint",
]

logger = logging.getLogger(__name__)

OnPrompt = Callable[[int, int], None]  # (prompt number from 1, prompts)

# A position is a near-tie when the source's top token leads the result's choice (or, for the
# decisive positions, its own runner-up) by at most this many nats of log-probability.
TIE_MARGIN = 0.5
MIN_DECISIVE = 16  # fewer decisive positions than this: the verdict is the mean KL
# relative KL: the mean KL(source || result) over the mean KL between the source's own
# distributions at different positions of a prompt (scale-free, so it judges a flat model too)
MAX_RELATIVE_KL = 0.05

TOKENIZER_CHECK_TEXT = (
    "Hello world! The quick brown fox, 1234567 apples; Café naïve résumé crème brûlée. "
    "你好\uff0c世界。こんにちは、世界\uff01 Emoji: 🙂🎉🍎 and tabs\tand\nnew lines  double  spaces."
)
_NO_TORCH = (
    "answers not compared: the source checkpoint needs torch and transformers to run "
    "(pip install 'edgeinfer[convert]')"
)
_HF_REFERENCE = "the Hugging Face checkpoint through transformers (float32)"

VALIDATION_PROMPTS = (
    "The capital of France is",
    "The largest planet in the solar system is",
    "Water freezes at a temperature of",
    "The first president of the United States was",
    "def add(a, b):\n    return",
    "Once upon a time, there was a",
    "The chemical symbol for gold is",
    "Monday, Tuesday, Wednesday,",
)


def validate_conversion(
    source: Path, folder: Path, manifest: Manifest, cfg: ConvertConfig
) -> dict[str, Any]:
    """Compare the checkpoint in ``source`` with the converted ONNX model in ``folder``."""
    reference = TransformersReference(source)
    with open_result(folder, manifest, cfg.threads) as model:
        return compare(reference, model, cfg)


def validate_gguf(cfg: ConvertConfig, result_path: Path, from_gguf: bool) -> dict[str, Any]:
    """The written GGUF ``result_path`` against its source: the tokenizer, then the answers
    (llama.cpp on a GGUF source; transformers on a checkpoint, when torch is installed)."""
    threads = cfg.threads
    with load(result_path, device="cpu", context_length=256, threads=threads) as model:
        tokenizer = check_gguf_tokenizer(cfg.src, model, from_gguf)
        if from_gguf:
            with load(cfg.src, device="cpu", context_length=256, threads=threads) as src:
                report = compare(ModelReference(src), model, cfg)
            report["reference"] = f"{cfg.src.name} through llama.cpp"
        elif _torch_installed():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = compare(TransformersReference(cfg.src), model, cfg)
            report["reference"] = _HF_REFERENCE
        else:
            report = {"skipped": _NO_TORCH + "; tokenizer checked"}
    report["tokenizer_check"] = tokenizer
    return report


def validate_native(
    cfg: ConvertConfig, folder: Path, manifest: Manifest, *, on_prompt: OnPrompt | None = None
) -> dict[str, Any]:
    """The ONNX ``folder`` built from the GGUF ``cfg.src`` against llama.cpp on that file."""
    if not llama_cpp_installed():
        return {
            "skipped": "answers not compared: llama.cpp, the reference for a GGUF source, is "
            "not installed (pip install 'edgeinfer[gguf]')"
        }
    try:
        with (
            open_result(folder, manifest, cfg.threads) as model,
            load(cfg.src, device="cpu", context_length=256, threads=cfg.threads) as ref,
        ):
            report = compare(ModelReference(ref), model, cfg, on_prompt=on_prompt)
    except ConversionError:
        raise
    except EdgeInferError as exc:  # the written folder does not load: a conversion failure
        raise ConversionError(f"the converted model could not be checked: {exc}") from exc
    report["reference"] = f"{cfg.src.name} through llama.cpp"
    return report


def validate_native_checkpoint(
    cfg: ConvertConfig,
    checkpoint: Path,
    folder: Path,
    manifest: Manifest,
    *,
    on_prompt: OnPrompt | None = None,
) -> dict[str, Any]:
    """The ONNX ``folder`` built from the safetensors ``checkpoint`` against transformers."""
    if not _torch_installed():
        return {"skipped": _NO_TORCH}
    with warnings.catch_warnings(), open_result(folder, manifest, cfg.threads) as model:
        warnings.simplefilter("ignore")
        report = compare(TransformersReference(checkpoint), model, cfg, on_prompt=on_prompt)
    report["reference"] = _HF_REFERENCE
    return report


def check_gguf_tokenizer(src: Path, model: Model, from_gguf: bool) -> dict[str, Any]:
    """The GGUF's tokenizer must give the source tokenizer's ids on a mixed-script text."""
    if from_gguf:
        return {"checked": False, "why": "quantization keeps the source's vocabulary"}
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return {"checked": False, "why": "the tokenizers library is not installed"}

    expected = (
        Tokenizer.from_file(str(src / "tokenizer.json"))
        .encode(TOKENIZER_CHECK_TEXT, add_special_tokens=False)
        .ids
    )
    got = model.tokenize(TOKENIZER_CHECK_TEXT, add_special=False)
    if list(expected) != list(got):
        first = _first_difference(expected, got)
        raise ConversionError(
            f"the GGUF tokenizer disagrees with {src / 'tokenizer.json'} from token {first} on "
            f"a test text ({len(got)} vs {len(expected)} tokens); nothing was written"
        )
    return {"checked": True, "tokens": len(got)}


def check_against_llama_cpp(
    gguf: Path, folder: Path, text: str = TOKENIZER_CHECK_TEXT
) -> dict[str, Any]:
    """Tokenize ``text`` with the written tokenizer.json and with llama.cpp on ``gguf``.
    Returns the report entry; raises ConversionError when the ids differ. Without
    llama-cpp-python the check is reported as not run."""
    from tokenizers import Tokenizer

    try:
        ours = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    except Exception as exc:  # the tokenizers library raises plain Exception
        raise ConversionError(
            f"{gguf.name}: the written tokenizer.json does not load: {exc}"
        ) from exc
    theirs = _llama_cpp_ids(gguf, text)
    if theirs is None:
        logger.info("llama-cpp-python is not installed: tokenizer ids not compared")
        return {"text": text, "ids": len(ours), "checked_against": None}
    if list(ours) != list(theirs):
        at = _first_difference(ours, theirs)
        raise ConversionError(
            f"{gguf.name}: the written tokenizer.json disagrees with llama.cpp on the check "
            f"text from id {at} ({list(ours[at : at + 5])} vs {list(theirs[at : at + 5])}); "
            "convert with --builder optimum"
        )
    return {"text": text, "ids": len(ours), "checked_against": "llama.cpp"}


def _llama_cpp_ids(gguf: Path, text: str) -> list[int] | None:
    """llama.cpp's ids for ``text`` from the vocabulary of ``gguf``; None without llama.cpp."""
    from edgeinfer.runtimes.llama_cpp import engine

    try:
        llama_cpp = engine()  # its log goes to edgeinfer's engine logger
    except BackendUnavailableError:
        return None
    try:
        ref = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    except ValueError as exc:  # llama-cpp-python: "Failed to load model from file"
        raise ConversionError(f"{gguf.name}: llama.cpp cannot read its vocabulary: {exc}") from exc
    try:
        return list(ref.tokenize(text.encode("utf-8"), add_bos=True, special=True))
    finally:
        ref.close()


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _torch_installed() -> bool:
    return bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"))


@contextmanager
def open_result(folder: Path, manifest: Manifest, threads: int | None) -> Iterator[Model]:
    """The converted folder (still marked partial) as a Model on the CPU, context 256."""
    from edgeinfer.runtimes.onnxruntime import open_backend  # imports onnxruntime

    cpu = plan_providers(devices(), "onnx", "cpu").candidates[0]  # validation runs on the CPU
    backend = open_backend(folder, LoadConfig(context_length=256, threads=threads), manifest, cpu)
    model = Model(backend, name=folder.name, path=folder, model_format="onnx")
    try:
        yield model
    finally:
        model.close()


def compare(
    reference: Any,
    model: Model,
    cfg: ConvertConfig,
    *,
    on_prompt: OnPrompt | None = None,
) -> dict[str, Any]:
    """Compare ``model`` with ``reference`` (anything with ``run(ids, n, is_eos)`` returning
    the greedy continuation and the next-token logits along it) on the fixed prompts;
    ``on_prompt(i, n)`` before each."""
    rows = []
    for i, prompt in enumerate(VALIDATION_PROMPTS, 1):
        if on_prompt is not None:
            on_prompt(i, len(VALIDATION_PROMPTS))
        rows.append(_compare(reference, model, prompt, cfg.validation_tokens))
    return _report(rows, cfg)


class TransformersReference:
    """The source checkpoint through transformers, in float32 (needs torch)."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self._model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def run(self, ids: list[int], n: int, is_eos: Any) -> tuple[list[int], np.ndarray]:
        torch = self._torch
        with torch.no_grad():
            out = self._model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            continuation = _until_eos([int(t) for t in out[0, len(ids) :]], is_eos)
            forced = ids + continuation[:-1] if continuation else ids
            # [positions, vocab]: the next-token logits after the prompt and each token
            logits = self._model(torch.tensor([forced])).logits[0, len(ids) - 1 :]
        return continuation, logits.float().numpy()


class ModelReference:
    """Another edgeinfer model as the reference (the unquantized GGUF, say): no torch."""

    def __init__(self, model: Model) -> None:
        self._model = model

    def run(self, ids: list[int], n: int, is_eos: Any) -> tuple[list[int], np.ndarray]:
        result = self._model.generate(ids, max_new_tokens=n, temperature=0)
        continuation = _until_eos(list(result.token_ids), is_eos)
        return continuation, teacher_forced(self._model, ids, continuation[:-1])


def _compare(reference: Any, model: Model, prompt: str, n: int) -> dict[str, Any]:
    ids = model.tokenize(prompt)
    eos = model.is_end_token
    continuation, src = reference.run(ids, n, eos)
    res = teacher_forced(model, ids, continuation[:-1])
    greedy = model.generate(ids, max_new_tokens=max(len(continuation), 1), temperature=0)
    figures = position_figures(src, res, continuation, list(greedy.token_ids))
    texts = {"source_text": model.detokenize(continuation), "result_text": greedy.text}
    return {"prompt": prompt, **figures, **texts}


def position_figures(
    src: np.ndarray, res: np.ndarray, continuation: Sequence[int], greedy: Sequence[int]
) -> dict[str, Any]:
    """One prompt's figures from the next-token logits ``src`` and ``res`` [positions, vocab]
    (teacher-forced along the source's greedy ``continuation``) and the result's own
    ``greedy`` continuation."""
    log_p = _log_softmax(src.astype(np.float64))
    top = src.argmax(-1)
    decisive = _top2_gap(log_p) > TIE_MARGIN
    agree = _common_prefix(continuation, greedy)
    tie = agree < min(len(continuation), len(greedy)) and bool(
        log_p[agree, top[agree]] - log_p[agree, greedy[agree]] <= TIE_MARGIN
    )
    whole = len(continuation) or 1
    return {
        "positions": len(src),
        "top1_matches": int((top == res.argmax(-1)).sum()),
        "decisive_positions": int(decisive.sum()),
        "decisive_matches": int((top == res.argmax(-1))[decisive].sum()),
        "kl": _mean_kl(src, res),
        "kl_across": _mean_kl(src, np.roll(src, max(len(src) // 2, 1), axis=0)),
        "greedy_prefix": agree,
        "greedy_fraction": agree / whole if continuation else 1.0,
        "parted_at_tie": tie,
        "greedy_fraction_beyond_ties": 1.0 if tie or not continuation else agree / whole,
    }


def _top2_gap(log_p: np.ndarray) -> np.ndarray:
    """Per position, how far (nats) the most likely token leads the runner-up."""
    if log_p.shape[-1] < 2:
        return np.full(log_p.shape[0], np.inf)
    two = np.partition(log_p, -2, axis=-1)[:, -2:]
    return two[:, 1] - two[:, 0]


def teacher_forced(model: Model, prompt: list[int], forced: Sequence[int]) -> np.ndarray:
    """``model``'s next-token log-probabilities after ``prompt`` and after each token of
    ``forced`` ([1 + len(forced), vocab]), through the public ``Model.score``."""
    scored = model.score(prompt, [*forced, 0], rows=True)  # the last token's own row unused
    assert scored.rows is not None
    return scored.rows


def _until_eos(tokens: list[int], is_eos: Any) -> list[int]:
    for i, token in enumerate(tokens):
        if is_eos(token):
            return tokens[:i]
    return tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _mean_kl(src: np.ndarray, res: np.ndarray) -> float:
    """Mean over positions of KL(p_src || p_res), in nats. src, res: [positions, vocab]."""
    log_p = _log_softmax(src.astype(np.float64))
    log_q = _log_softmax(res.astype(np.float64))
    return float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _report(rows: list[dict[str, Any]], cfg: ConvertConfig) -> dict[str, Any]:
    figures = agreement(rows)
    if figures["decisive_positions"] >= MIN_DECISIVE:
        passed = (
            figures["decisive_top1_agreement"] >= cfg.min_top1_agreement
            and figures["greedy_agreement_beyond_ties"] >= cfg.min_greedy_agreement
        )
        verdict = "decisive top-1 and greedy agreement beyond ties"
    else:  # thresholds of 0 ask for no verdict
        lax = cfg.min_top1_agreement == 0 and cfg.min_greedy_agreement == 0
        passed = lax or figures["relative_kl"] <= MAX_RELATIVE_KL
        verdict = f"relative KL (fewer than {MIN_DECISIVE} decisive positions)"
    return {
        "prompts": len(rows),
        **figures,
        "tie_margin": TIE_MARGIN,
        "thresholds": {
            "top1": cfg.min_top1_agreement,
            "greedy": cfg.min_greedy_agreement,
            "relative_kl": MAX_RELATIVE_KL,
        },
        "judged_by": verdict,
        "passed": passed,
        "per_prompt": rows,
    }


def agreement(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The pooled figures of per-prompt rows (``position_figures``)."""
    positions = sum(r["positions"] for r in rows)
    decisive = sum(r["decisive_positions"] for r in rows)

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in rows])) if rows else 1.0

    return {
        "positions": positions,
        "top1_agreement": round(sum(r["top1_matches"] for r in rows) / max(positions, 1), 4),
        "decisive_positions": decisive,
        "decisive_top1_agreement": round(
            sum(r["decisive_matches"] for r in rows) / decisive if decisive else 1.0, 4
        ),
        "greedy_agreement": round(mean("greedy_fraction"), 4),
        "greedy_agreement_beyond_ties": round(mean("greedy_fraction_beyond_ties"), 4),
        "mean_greedy_prefix": round(mean("greedy_prefix"), 2),
        "mean_kl": round(mean("kl"), 6),
        "relative_kl": round(
            sum(r["kl"] for r in rows) / max(sum(r["kl_across"] for r in rows), 1e-30), 6
        ),
    }


def summary(report: dict[str, Any]) -> str:
    """The agreement line of a validation report, as ``edgeinfer convert`` prints it."""
    t = report["thresholds"]
    head = (
        f"top-1 agreement {report['top1_agreement']:.1%}, greedy agreement "
        f"{report['greedy_agreement']:.1%}, mean KL {report['mean_kl']:.4f} over "
        f"{report['positions']} positions of {report['prompts']} prompts"
    )
    if "decisive_top1_agreement" not in report:  # a report written before the tie margin
        return head
    if report["judged_by"].startswith("decisive"):
        return (
            f"{head}; judged beyond near-ties (margin {report['tie_margin']} nats): decisive "
            f"top-1 {report['decisive_top1_agreement']:.1%} of {report['decisive_positions']} "
            f"positions (min {t['top1']:.0%}), greedy beyond ties "
            f"{report['greedy_agreement_beyond_ties']:.1%} (min {t['greedy']:.0%})"
        )
    return (
        f"{head}; judged by {report['judged_by']}: {report['relative_kl']:.4f} "
        f"(max {t['relative_kl']})"
    )
