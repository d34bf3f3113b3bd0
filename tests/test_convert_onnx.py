"""ONNX conversion on a tiny random Llama built in the session: export, validate, atomic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer import ConversionError, ModelLoadError
from edgeinfer.files.manifest import MANIFEST_NAME, PARTIAL_MARKER

from .leakcheck import KillAtEnd

pytest.importorskip("optimum.exporters.onnx", reason="needs the convert extra")

PROMPTS = ["The capital of France is", "Café, naïve", "def add(a, b):", "你好", "Emoji: 🙂"]


@pytest.fixture(scope="session")
def tiny_onnx(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edgeinfer.converters import convert

    out = tmp_path_factory.mktemp("tiny-onnx") / "fp32"
    convert(tiny_hf, out, quant="fp32")
    return out


def test_output_folder_is_self_contained(tiny_onnx: Path, tiny_hf: Path) -> None:
    names = {p.name for p in tiny_onnx.iterdir()}
    assert {
        "model.onnx",
        "tokenizer.json",
        "chat_template.jinja",
        "generation_config.json",
        MANIFEST_NAME,
    } <= names
    assert not any(n.startswith((".", "_")) for n in names)
    manifest = json.loads((tiny_onnx / MANIFEST_NAME).read_text())
    assert manifest["source"]["kind"] == "hf" and len(manifest["source"]["sha256"]) == 64
    assert manifest["quantization"]["method"] == "fp32"
    arch = manifest["architecture"]
    assert (arch["num_layers"], arch["num_kv_heads"], arch["head_dim"]) == (2, 2, 16)
    assert manifest["validation"]["passed"] and manifest["validation"]["top1_agreement"] == 1.0


def test_greedy_ids_equal_transformers(tiny_onnx: Path, tiny_hf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_hf).eval()
    with edgeinfer.load(tiny_onnx, context_length=128) as model:
        for prompt in PROMPTS:
            ids = model.tokenize(prompt)
            ours = model.generate(ids, max_new_tokens=32, temperature=0).token_ids
            with torch.no_grad():
                out = reference.generate(
                    torch.tensor([ids]),
                    max_new_tokens=len(ours),
                    min_new_tokens=len(ours),
                    do_sample=False,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    pad_token_id=0,
                )
            assert list(ours) == out[0, len(ids) :].tolist(), prompt


def test_tokenizer_matches_the_source(tiny_onnx: Path, tiny_hf: Path) -> None:
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(tiny_hf)
    text = "Plain ASCII, accents déjà vu, CJK 你好世界 こんにちは, emoji 🙂🎉 <|im_end|>"
    with edgeinfer.load(tiny_onnx) as model:
        ids = model.tokenize(text)
        assert ids == source(text)["input_ids"]
        assert model.detokenize(ids) == text.replace("<|im_end|>", "")


def test_pickle_weights_are_refused(tmp_path: Path, tiny_hf: Path) -> None:
    from edgeinfer.converters import convert

    folder = tmp_path / "pickled"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_hf / name).read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    with pytest.raises(ConversionError, match="allow-pickle"):
        convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(tiny_hf: Path, tmp_path: Path) -> None:
    from edgeinfer.converters import convert

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="--overwrite"):
        convert(tiny_hf, out, quant="fp32")
    assert (out / "keep.txt").read_text() == "mine"


def test_failed_validation_writes_nothing_and_keeps_the_old_output(
    tiny_hf: Path, tmp_path: Path
) -> None:
    from edgeinfer.converters import convert

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ConversionError, match="validation failed") as info:
        # int4 of random weights cannot agree perfectly: demand perfection to force a failure
        convert(
            tiny_hf,
            out,
            quant="int4",
            overwrite=True,
            min_top1_agreement=1.0,
            min_greedy_agreement=1.0,
        )
    assert "top-1 agreement" in str(info.value)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no partial folder left


# quant -> (top-1 agreement, lowest per-position cosine) against transformers on the source;
# measured on the tiny random model: int8 0.86 / 0.994, int4 0.57 / 0.84, fp16 1.0 / 0.99999
AGREEMENT_FLOORS = {"int8": (0.7, 0.98), "int4": (0.3, 0.6), "fp16": (0.95, 0.999)}


@pytest.mark.parametrize("quant", ["int8", "int4", "fp16"])
def test_every_quantization_agrees_with_the_source(
    tiny_hf: Path, tmp_path: Path, quant: str
) -> None:
    """Every position's logits from the converted folder against transformers' on the
    checkpoint, computed in this run: each quantization holds its floor."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from edgeinfer.converters import convert

    result = convert(
        tiny_hf, tmp_path / quant, quant=quant, min_top1_agreement=0.0, min_greedy_agreement=0.0
    )
    reference = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    text = "The capital of France is Paris. Café, 你好 🙂 def add(a, b): return a + b"
    with edgeinfer.load(result.path, context_length=128, threads=1) as model:
        assert model.info["quantization"] == quant
        ids = model.tokenize(text)
        ours = []
        for n in range(1, len(ids) + 1):
            model._backend.rewind(0)
            ours.append(np.asarray(model._backend.prefill(ids[:n]), dtype=np.float64))
        model._backend.rewind(0)
        assert model.generate("Paris", max_new_tokens=4, temperature=0).stats.completion_tokens
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].double().numpy()
    got = np.stack(ours)
    top1 = float((got.argmax(-1) == expected.argmax(-1)).mean())
    cosine = (got * expected).sum(-1) / np.linalg.norm(got, axis=-1)
    cosine /= np.linalg.norm(expected, axis=-1)
    floor_top1, floor_cosine = AGREEMENT_FLOORS[quant]
    assert top1 >= floor_top1, (quant, top1)
    assert float(cosine.min()) >= floor_cosine, (quant, cosine.min())
    assert result.report["top1_agreement"] >= floor_top1  # the converter's own check agrees


def test_sigkill_mid_conversion_leaves_no_output(
    tiny_hf: Path, tmp_path: Path, kill_at_end: KillAtEnd
) -> None:
    out = tmp_path / "killed"
    proc = kill_at_end(subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgeinfer.cli",
            "convert",
            str(tiny_hf),
            "-o",
            str(out),
            "--quant",
            "int4",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ},
    ))  # fmt: skip
    deadline = time.monotonic() + 120
    partials: list[Path] = []
    while time.monotonic() < deadline and not partials:
        partials = [p for p in tmp_path.glob(".killed.partial-*") if (p / "_work").exists()]
        time.sleep(0.05)
    assert partials, "the conversion never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    with pytest.raises(ModelLoadError, match="unfinished conversion"):
        edgeinfer.load(partials[0])
    assert (partials[0] / PARTIAL_MARKER).exists()
    # the next conversion of the same output sweeps the dead one's leftovers away
    from edgeinfer.converters import convert

    convert(tiny_hf, out, quant="fp32")
    assert not partials[0].exists() and (out / MANIFEST_NAME).exists()


def test_bad_options_are_conversion_errors(tiny_hf: Path, tmp_path: Path) -> None:
    from edgeinfer.converters import convert

    with pytest.raises(ConversionError, match="quant"):
        convert(tiny_hf, tmp_path / "x", quant="int3")
    with pytest.raises(ConversionError, match="no such file"):
        convert(tmp_path / "missing", tmp_path / "x")
    with pytest.raises(ConversionError, match="unknown conversion option"):
        convert(tiny_hf, tmp_path / "x", colour="blue")
