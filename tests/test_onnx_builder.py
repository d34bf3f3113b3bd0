"""The native ONNX builder: a GGUF becomes a GroupQueryAttention/MatMulNBits graph whose
logits match llama.cpp's on the same file, with no torch, transformers or optimum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edgeinfer
from edgeinfer.converters.onnx.builder import build_onnx_from_gguf

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


class Decoder:
    """The built graph run step by step, the KV cache carried from presents to pasts."""

    def __init__(self, folder: Path) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.past: dict[str, np.ndarray] = {}
        for i in self.session.get_inputs():
            if i.name.startswith("past_key_values"):
                _, heads, _, dim = i.shape
                self.past[i.name] = np.zeros((1, heads, 0, dim), np.float32)
        self.length = 0

    def __call__(self, ids: list[int]) -> np.ndarray:
        self.length += len(ids)
        feed = {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, self.length), np.int64),
            **self.past,
        }
        if any(i.name == "num_logits_to_keep" for i in self.session.get_inputs()):
            feed["num_logits_to_keep"] = np.array([1], np.int64)
        names = [o.name for o in self.session.get_outputs()]
        outs = dict(zip(names, self.session.run(None, feed), strict=True))
        for name in self.past:
            self.past[name] = outs[name.replace("past_key_values", "present")]
        return outs["logits"][0, -1]


def _reference_logits(gguf: Path, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    with edgeinfer.load(gguf, context_length=256, threads=1) as model:
        backend = model._backend
        out = [np.array(backend.prefill(prompt), copy=True)]
        for t in steps:
            out.append(np.array(backend.decode(t), copy=True))
    return out


_TINY_GGUFS = {"llama": "tiny_llama_gguf", "qwen2": "tiny_qwen2_gguf", "gemma3": "tiny_gemma_gguf"}


@pytest.fixture(params=sorted(_TINY_GGUFS))
def tiny_gguf(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """The tiny random models as f32 GGUFs: Llama (tied, interleaved rotary), Qwen2 (q/k/v
    biases, rotary by halves, untied output) and Gemma 3 (q/k norms, post-norms, GELU,
    sliding-window layers with their own rotary base)."""
    return request.param, request.getfixturevalue(_TINY_GGUFS[request.param])


@pytest.mark.parametrize("quant", ["keep", "int8"])
def test_gguf_graph_matches_llama_cpp(
    tiny_gguf: tuple[str, Path], tmp_path: Path, quant: str
) -> None:
    """f32 weights kept as floats give llama.cpp's logits; re-rounded to 8 bits, its greedy
    choices within int8 noise."""
    arch, gguf = tiny_gguf
    out = tmp_path / "built"
    out.mkdir()
    report = build_onnx_from_gguf(gguf, out, quant=quant, max_context=256)
    assert report.architecture == arch and report.widened == {}
    # 20 prompt tokens and 4 steps: past the tiny Gemma's 16-token sliding window
    prompt = [1, 5, 9, 200, 17, 33, 4, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    steps = [7, 99, 3, 5]
    want = _reference_logits(gguf, prompt, steps)
    decoder = Decoder(out)
    got = [decoder(prompt)] + [decoder([t]) for t in steps]
    for g, w in zip(got, want, strict=True):
        scale = float(np.abs(w).max())
        if quant == "keep":
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3 * scale)
            assert int(np.argmax(g)) == int(np.argmax(w))
        else:
            assert w[int(np.argmax(g))] >= w.max() - 0.05 * scale


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    from edgeinfer.converters.onnx.builder import gguf_shape
    from edgeinfer.errors import ConversionError
    from edgeinfer.files.gguf_file import GGUFHeader

    header = GGUFHeader(tmp_path / "m.gguf", 3, 0, 0, {"general.architecture": "mamba"}, ())
    with pytest.raises(ConversionError, match=r"'mamba' is not supported .*supported: llama"):
        gguf_shape(header)


@pytest.mark.model
def test_default_gguf_keeps_its_blocks_and_answers_like_llama_cpp(
    default_gguf: Path, tmp_path: Path
) -> None:
    import subprocess
    import sys

    out = tmp_path / "native"
    out.mkdir()
    # in a fresh interpreter, to prove the builder imports no torch, transformers or optimum
    code = (
        "import sys, json\n"
        "from edgeinfer.converters.onnx.builder import build_onnx_from_gguf\n"
        f"r = build_onnx_from_gguf({str(default_gguf)!r}, {str(out)!r}, max_context=512)\n"
        "heavy = [m for m in ('torch', 'transformers', 'optimum') if m in sys.modules]\n"
        "print(json.dumps({'nbits': r.nbits, 'widened': r.widened, 'heavy': heavy}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import json

    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert built["heavy"] == [] and built["widened"] == {}
    assert built["nbits"] == {"4-bit/32": 210, "8-bit/32": 1}  # Q4_1 linears, Q8_0 lm_head
    with edgeinfer.load(default_gguf, context_length=256, threads=1) as model:
        prompts = [model.tokenize(p) for p in ("The capital of France is", "1, 2, 3, 4,")]
        paris = model.tokenize(" Paris", add_special=False)[0]
    for prompt in prompts:
        (want,) = _reference_logits(default_gguf, prompt, [])
        got = Decoder(out)(prompt)
        assert int(np.argmax(got)) == int(np.argmax(want))
    got = Decoder(out)(prompts[0])
    assert int(np.argmax(got)) == paris


def test_native_folder_loads_and_generates_like_llama_cpp(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    folder = tmp_path / "native"
    folder.mkdir()
    write_gguf_folder(tiny_llama_gguf, folder, max_context=256)
    prompt, steps = [1, 5, 9, 200, 17, 33, 4, 250], [7, 99, 3]
    want = _reference_logits(tiny_llama_gguf, prompt, steps)
    with edgeinfer.load(folder, context_length=256, threads=1) as model:
        assert model.info["memory_plan"]["context_length"] == 256
        backend = model._backend
        for chunked in (False, True):  # one run, then prefill in chunks of 3
            backend.rewind(0)
            backend._chunk = 3 if chunked else 256
            got = [np.array(backend.prefill(prompt), copy=True)]
            got += [np.array(backend.decode(t), copy=True) for t in steps]
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3 * float(np.abs(w).max()))
        # rewinding keeps the buffer: the prompt's first half is reused
        backend.rewind(4)
        again = np.array(backend.prefill(prompt[4:]), copy=True)
        np.testing.assert_allclose(
            again, want[0], rtol=1e-3, atol=1e-3 * float(np.abs(want[0]).max())
        )
        ours = model.generate(prompt, max_new_tokens=8, temperature=0).token_ids
    # every greedy choice is llama.cpp's best token, or within float noise of it (a near-tie
    # may fall either way on another CPU)
    reference = _reference_logits(tiny_llama_gguf, prompt, list(ours[:-1]))
    for token, logits in zip(ours, reference, strict=True):
        assert logits[token] >= logits.max() - 1e-3 * float(np.abs(logits).max())
