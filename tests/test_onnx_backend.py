"""The ONNX path on the real default model (marked `model`): conversions and fidelity."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer import ConversionError

pytestmark = pytest.mark.model
pytest.importorskip("optimum.exporters.onnx", reason="needs the convert extra")

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]
MIXED_TEXT = "Plain ASCII, déjà vu à la crème, 你好世界, こんにちは, emoji 🙂🎉🍎 <|im_end|>"


def test_fp32_greedy_ids_equal_transformers(
    default_onnx: Callable[[str], Path], default_checkpoint: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(default_checkpoint).eval()
    with edgeinfer.load(default_onnx("fp32"), context_length=256) as model:
        for prompt in PROMPTS:
            ids = model.tokenize(prompt)
            ours = list(model.generate(ids, max_new_tokens=32, temperature=0).token_ids)
            with torch.no_grad():
                out = reference.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=32,
                    do_sample=False,
                    pad_token_id=0,
                )
            theirs = out[0, len(ids) :].tolist()
            assert ours == theirs[: len(ours)] and len(ours) in (len(theirs), len(theirs) - 1)


def test_onnx_tokenizer_equals_the_gguf_tokenizer(
    default_onnx: Callable[[str], Path], default_gguf: Path
) -> None:
    with (
        edgeinfer.load(default_gguf, context_length=64) as gguf,
        edgeinfer.load(default_onnx("fp32"), context_length=64) as onnx,
    ):
        assert onnx.tokenize(MIXED_TEXT) == gguf.tokenize(MIXED_TEXT)
        ids = gguf.tokenize(MIXED_TEXT)
        assert onnx.detokenize(ids) == gguf.detokenize(ids)


# The lowest agreement with the fp32 source each quantization may report (top-1, greedy) and
# the highest mean KL: the README's validation table (results/onnx-validation.json) less a
# margin, so a converter change that costs fidelity fails here.
FLOORS = {
    "fp32": (1.0, 1.0, 1e-4),
    "int8wo": (0.90, 0.60, 0.01),  # passes the default thresholds
    "int4": (0.55, 0.10, 0.6),
    # int8 after issue 28 (7-bit weights, down projections and edge layers float): 92.2 / 46.9
    "int8": (0.85, 0.35, 0.06),
}


@pytest.mark.parametrize(
    "quant",
    [
        "fp32",
        "int8wo",
        "int4",
        "int8",
    ],
)
def test_quantized_models_report_their_agreement(
    default_onnx: Callable[[str], Path], quant: str
) -> None:
    """Each quantization is validated against its source in the same run, at or above its
    floor; those that pass the default thresholds load and answer."""
    import json

    folder = default_onnx(quant)
    report = json.loads((folder / "edgeinfer.json").read_text())["validation"]
    top1, greedy, kl = FLOORS[quant]
    assert report["positions"] == 128, report
    assert report["top1_agreement"] >= top1 and report["greedy_agreement"] >= greedy, report
    assert report["mean_kl"] <= kl, report
    if report["top1_agreement"] >= 0.90 and report["greedy_agreement"] >= 0.60:
        with edgeinfer.load(folder, context_length=128) as model:
            text = model.generate("The capital of France is", max_new_tokens=16, temperature=0)
            assert text.token_ids and text.finish_reason in ("stop", "length")


def test_cli_converts_the_gguf_and_runs_it(default_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "smol-onnx"
    conv = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeinfer.cli",
            "convert",
            str(default_gguf),
            "-o",
            str(out),
            "--to",
            "onnx",
            "--builder",
            "optimum",
            "--quant",
            "fp32",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert conv.returncode == 0, conv.stderr
    assert "top-1 agreement 100.0%" in conv.stderr and conv.stdout.strip() == str(out)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeinfer.cli",
            "run",
            str(out),
            "-p",
            "The capital of France is",
            "-n",
            "16",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    with edgeinfer.load(out) as model:  # the folder the CLI wrote, read through the API
        expected = model.generate("The capital of France is", max_new_tokens=16, temperature=0)
    assert expected.text and run.stdout.rstrip("\n") == expected.text.rstrip("\n")


def test_default_thresholds_reject_a_lossy_quantization(
    default_checkpoint: Path, tmp_path: Path
) -> None:
    """Symmetric int4 of the Q4_1 model loses its answers: validation must refuse it."""
    from edgeinfer.converters import convert

    with pytest.raises(ConversionError, match="validation failed") as info:
        convert(default_checkpoint, tmp_path / "int4-sym", quant="int4", int4_symmetric=True)
    assert "The capital of France is" in str(info.value) or "top-1" in str(info.value)
    assert not (tmp_path / "int4-sym").exists()
