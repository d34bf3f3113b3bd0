"""GGUF -> ONNX through the native builder: the tokenizer written from the GGUF gives
llama.cpp's ids, `edgeinfer convert` picks the builder and the target by itself, every
--quant the builder writes loads and answers, and a catalog GGUF runs through ONNX Runtime
without llama.cpp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeinfer
from edgeinfer.cli import main as cli_main
from edgeinfer.converters.config import ConvertConfig
from edgeinfer.errors import ConversionError
from edgeinfer.files import catalog
from edgeinfer.files.gguf_file import read_gguf_header

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
pytest.importorskip("tokenizers")

TEXTS = (
    "Hello world! The quick brown fox, 1234567 apples; Café naïve résumé crème brûlée.",
    "你好\uff0c世界。こんにちは、世界\uff01 Emoji: 🙂🎉🍎",
    " leading space, tabs\tand\nnew lines  double   spaces\n\n\n",
    "don't I'LL we've 3.14159 -42 x=y+1",
    "",
)


def _llama_ids(gguf: Path, text: str) -> list[int]:
    from edgeinfer.runtimes.llama_cpp import engine

    llama_cpp = engine()
    ref = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        return list(ref.tokenize(text.encode("utf-8"), add_bos=True, special=True))
    finally:
        ref.close()


def _check_vocabulary(gguf: Path, tmp_path: Path, extra: tuple[str, ...] = ()) -> None:
    from tokenizers import Tokenizer

    from edgeinfer.converters.onnx.vocab import read_gguf_vocabulary, write_tokenizer_files

    pytest.importorskip("llama_cpp")
    vocab = read_gguf_vocabulary(gguf)
    write_tokenizer_files(vocab, tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in (*TEXTS, *extra):
        assert tok.encode(text).ids == _llama_ids(gguf, text), text


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bpe_vocabulary_gives_llama_cpp_ids(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    gguf = request.getfixturevalue(f"tiny_{family}_gguf")
    _check_vocabulary(gguf, tmp_path)


def test_sentencepiece_vocabulary_gives_llama_cpp_ids(
    tiny_gemma_gguf: Path, tmp_path: Path
) -> None:
    from edgeinfer.converters.onnx.vocab import read_gguf_vocabulary

    vocab = read_gguf_vocabulary(tiny_gemma_gguf)
    assert vocab.model == "llama" and vocab.scores  # SentencePiece: pieces merge by score
    turn = "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
    _check_vocabulary(tiny_gemma_gguf, tmp_path, extra=(turn, "<table> after a marker"))


@pytest.mark.model
def test_default_model_vocabulary_gives_llama_cpp_ids(default_gguf: Path, tmp_path: Path) -> None:
    chat = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    _check_vocabulary(default_gguf, tmp_path, extra=(chat,))


def test_vocabulary_of_an_unknown_kind_is_refused(tmp_path: Path) -> None:
    from edgeinfer.converters.onnx.vocab import read_gguf_vocabulary

    gguf = pytest.importorskip("gguf")
    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConversionError, match=r"tokenizer model 'rwkv'.*Hugging Face folder"):
        read_gguf_vocabulary(path)


# -- the settings ---------------------------------------------------------------------------


def test_target_and_builder_follow_the_paths(tiny_llama_gguf: Path, tiny_hf: Path) -> None:
    cfg = ConvertConfig(tiny_llama_gguf, Path("out"))
    assert (cfg.to, cfg.builder, cfg.quant) == ("onnx", "native", "keep")
    cfg = ConvertConfig(tiny_llama_gguf, Path("small.GGUF"), quant="q8_0")
    assert (cfg.to, cfg.builder) == ("gguf", None)
    cfg = ConvertConfig(tiny_hf, Path("out"))
    assert (cfg.to, cfg.builder, cfg.quant) == ("onnx", "optimum", "int8")
    cfg = ConvertConfig(tiny_llama_gguf, Path("out"), builder="optimum")
    assert cfg.quant == "int8"
    cfg = ConvertConfig(tiny_hf, Path("out"), builder="native")
    assert (cfg.builder, cfg.quant) == ("native", "keep")
    with pytest.raises(ConversionError, match="reads a GGUF file or a Hugging Face folder"):
        ConvertConfig(tiny_hf / "config.json", Path("out"), builder="native")
    with pytest.raises(ConversionError, match="--head-8bit applies to --quant int4"):
        ConvertConfig(tiny_llama_gguf, Path("out"), quant="int8", head_bits=8)
    with pytest.raises(ConversionError, match=r"'keep' is not an ONNX quantization.*native"):
        ConvertConfig(tiny_hf, Path("out"), quant="keep")
    with pytest.raises(ConversionError, match="'int8wo' is not written by the native"):
        ConvertConfig(tiny_llama_gguf, Path("out"), quant="int8wo")
    with pytest.raises(ConversionError, match="--builder applies to --to onnx only"):
        ConvertConfig(tiny_llama_gguf, Path("x.gguf"), builder="native")


def test_convert_help_names_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "gguf when OUT ends in .gguf, else onnx" in text
    assert "keep (the default: the GGUF's blocks, lossless)" in text
    assert "native (contrib-operator graph, no torch; the default for a GGUF)" in text
    assert "--int4-block-size N optimum int4: weights per quantization block" in text


# -- the conversion -------------------------------------------------------------------------


def test_cli_converts_a_gguf_natively_with_progress(
    tiny_llama_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("llama_cpp")
    out = tmp_path / "native"
    assert cli_main(["convert", str(tiny_llama_gguf), "-o", str(out), "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "native builder" in err
    n = len(read_gguf_header(tiny_llama_gguf).tensors)
    assert f"tensors written: {n}/{n}" in err
    assert "prompt 8/8" in err
    manifest = json.loads((out / "edgeinfer.json").read_text())
    assert manifest["quantization"]["builder"] == "native"
    assert manifest["architecture"]["kv_cache"] == "shared"
    report = manifest["validation"]
    assert report["passed"] and report["reference"].endswith("through llama.cpp")
    assert report["tokenizer_check"]["checked_against"] == "llama.cpp"
    # the f32 source is kept as floats: the graph gives llama.cpp's greedy answer
    assert report["top1_agreement"] >= 0.95
    assert not list(tmp_path.glob(".native.partial*"))


def test_cli_converts_a_sentencepiece_gemma_and_checks_its_tokenizer(
    tiny_gemma_gguf: Path, tmp_path: Path
) -> None:
    """The GGUF's own vocabulary, checked against llama.cpp: the reference never shares the
    result's tokenizer."""
    pytest.importorskip("llama_cpp")
    out = tmp_path / "gemma"
    assert cli_main(["convert", str(tiny_gemma_gguf), "-o", str(out), "--threads", "1"]) == 0
    manifest = json.loads((out / "edgeinfer.json").read_text())
    assert manifest["architecture"]["model_type"] == "gemma3"
    assert manifest["quantization"]["tokenizer"]["model"] == "llama"  # SentencePiece
    report = manifest["validation"]
    assert report["tokenizer_check"]["checked_against"] == "llama.cpp"
    assert report["passed"] and report["top1_agreement"] >= 0.95
    with edgeinfer.load(out, context_length=128, threads=1) as model:
        text = "<start_of_turn>user\nhello<end_of_turn>\n"
        assert model.tokenize(text) == _llama_ids(tiny_gemma_gguf, text)


AGREEMENT_TEXT = "The capital of France is Paris. Café, 你好 🙂 def add(a, b): return a + b"
# quant -> (top-1 agreement, lowest per-position cosine) against llama.cpp on the source
AGREEMENT_FLOORS = {"keep": (1.0, 0.9999), "fp32": (1.0, 0.9999), "int8": (0.85, 0.99),
                    "int4": (0.25, 0.5)}  # fmt: skip


def _llama_cpp_logits(gguf: Path, text: str) -> tuple[list[int], np.ndarray]:
    """(ids, every position's logits) from llama.cpp with a float32 KV cache."""
    pytest.importorskip("llama_cpp")
    from edgeinfer.bench.peers import policy_llama

    f32_cache = 0  # GGML_TYPE_F32
    ref = policy_llama(str(gguf), n_ctx=128, logits_all=True, type_k=f32_cache,
                       type_v=f32_cache, verbose=False)  # fmt: skip
    try:
        ids = list(ref.tokenize(text.encode(), add_bos=True))
        ref.eval(ids)
        return ids, np.array(ref.scores[: len(ids)], dtype=np.float64)
    finally:
        ref.close()


@pytest.mark.parametrize("quant", ["keep", "fp32", "int8", "int4"])
def test_every_native_quant_loads_and_answers(
    tiny_llama_gguf: Path, tmp_path: Path, quant: str
) -> None:
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    folder = tmp_path / quant
    folder.mkdir()
    _, report = write_gguf_folder(tiny_llama_gguf, folder, quant=quant, max_context=128)
    # the tiny model's f32 weights stay floats unless int8/int4 re-round them
    kinds = {"keep": set(), "fp32": set(), "int8": {"8-bit/32"}, "int4": {"4-bit/32"}}
    assert set(report.nbits) == kinds[quant]
    ids, reference = _llama_cpp_logits(tiny_llama_gguf, AGREEMENT_TEXT)
    with edgeinfer.load(folder, context_length=128, threads=1) as model:
        assert model.tokenize(AGREEMENT_TEXT) == ids
        ours = []
        for n in range(1, len(ids) + 1):  # every position, each from a fresh prefill
            model._backend.rewind(0)
            ours.append(np.asarray(model._backend.prefill(ids[:n]), dtype=np.float64))
        model._backend.rewind(0)
        result = model.generate("Hello", max_new_tokens=4, temperature=0)
    got = np.stack(ours)
    top1 = float((got.argmax(-1) == reference.argmax(-1)).mean())
    cosine = (got * reference).sum(-1) / np.linalg.norm(got, axis=-1)
    cosine /= np.linalg.norm(reference, axis=-1)
    # floors against llama.cpp on the same f32 GGUF, this run (measured: floats 1.0 / 1e-5,
    # int8 top-1 0.96 cosine >= 0.997, int4 of random weights top-1 0.46 cosine >= 0.69)
    floor_top1, floor_cosine = AGREEMENT_FLOORS[quant]
    assert top1 >= floor_top1, (quant, top1)
    assert float(cosine.min()) >= floor_cosine, (quant, cosine.min())
    if quant in ("keep", "fp32"):
        assert float(np.abs(got - reference).max()) < 1e-3
    assert len(result.token_ids) >= 1


def test_native_build_rejects_a_quant_it_does_not_write(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    from edgeinfer.converters.onnx.builder import build_onnx_from_gguf

    with pytest.raises(ConversionError, match="keep, int4, int8, fp32"):
        build_onnx_from_gguf(tiny_llama_gguf, tmp_path, quant="fp16")


@pytest.mark.model
def test_default_gguf_converts_without_torch(
    default_gguf: Path, default_model: Any, tmp_path: Path
) -> None:
    """The whole `edgeinfer convert` of the default GGUF in a fresh interpreter: no torch,
    transformers or optimum imported; the converted graph's greedy answer starts with the
    token llama.cpp picks on the same file (computed in this run, not a recorded word)."""
    pytest.importorskip("llama_cpp")
    out = tmp_path / "smollm2-onnx"
    code = textwrap.dedent(
        f"""
        import json, resource, sys
        from edgeinfer.cli import main
        rc = main(["convert", {str(default_gguf)!r}, "-o", {str(out)!r}, "--threads", "2"])
        heavy = [m for m in ("torch", "transformers", "optimum") if m in sys.modules]
        print(json.dumps({{"rc": rc, "heavy": heavy}}))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    done = json.loads(run.stdout.strip().splitlines()[-1])
    assert done == {"rc": 0, "heavy": []}
    report = json.loads((out / "edgeinfer.json").read_text())["validation"]
    assert report["passed"]
    prompt = "The capital of France is"
    want = default_model.generate(prompt, max_new_tokens=1, temperature=0).token_ids
    with edgeinfer.load(out, context_length=256, threads=2) as model:
        answer = model.generate(prompt, max_new_tokens=4, temperature=0)
    assert answer.token_ids[:1] == want


# -- a Hugging Face folder through the native builder -------------------------------------

_TINY = {"llama": ("tiny_hf", "tiny_llama_gguf"), "qwen2": ("tiny_qwen2_hf", "tiny_qwen2_gguf"),
         "gemma3": ("tiny_gemma_hf", "tiny_gemma_gguf")}  # fmt: skip


@pytest.mark.parametrize("family", sorted(_TINY))
def test_safetensors_folder_builds_the_graph_its_gguf_builds(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The same weights from the Hugging Face folder and from its f32 GGUF give the same
    logits: names mapped, Llama's unpermuted q/k rotated by halves, Gemma's norms +1."""
    from edgeinfer.converters.onnx.builder import build_onnx_from_gguf

    from .test_onnx_builder import Decoder

    hf, gguf = (request.getfixturevalue(name) for name in _TINY[family])
    prompt = [1, 5, 9, 200, 17, 33, 4, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    logits = []
    for src in (hf, gguf):
        out = tmp_path / src.name
        out.mkdir()
        report = build_onnx_from_gguf(src, out, max_context=256)
        assert report.architecture == family
        decoder = Decoder(out)
        logits.append([decoder(prompt)] + [decoder([t]) for t in (7, 99, 3)])
    for a, b in zip(*logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))


def test_cli_converts_a_safetensors_folder_natively(
    tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "native-hf"
    argv = ["convert", str(tiny_hf), "-o", str(out), "--builder", "native", "--threads", "1"]
    assert cli_main(argv) == 0
    manifest = json.loads((out / "edgeinfer.json").read_text())
    assert manifest["quantization"]["builder"] == "native"
    report = manifest["validation"]
    assert report["passed"] and "transformers" in report["reference"]
    assert report["top1_agreement"] >= 0.95  # float weights: transformers' own answers
    assert (out / "tokenizer.json").is_file() and "prompt 8/8" in capsys.readouterr().err
    quantized = tmp_path / "int4"
    argv = ["convert", str(tiny_hf), "-o", str(quantized), "--builder", "native"]
    argv += ["--quant", "int4", "--head-8bit", "--min-top1", "0", "--min-greedy", "0"]
    assert cli_main(argv) == 0
    nbits = json.loads((quantized / "edgeinfer.json").read_text())["quantization"]["nbits"]
    assert set(nbits) == {"4-bit/32", "8-bit/32"}  # the tied head at 8 bits


# -- a catalog GGUF without llama.cpp -------------------------------------------------------

_WITHOUT_LLAMA_CPP = """
import importlib.abc, importlib.util, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "llama_cpp":
            raise ImportError("llama_cpp is blocked for this test")
_find = importlib.util.find_spec
def _find_spec(name, *args, **kwargs):
    return None if name.split(".")[0] == "llama_cpp" else _find(name, *args, **kwargs)
importlib.util.find_spec = _find_spec
sys.meta_path.insert(0, _Blocked())
from edgeinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.model
def test_catalog_model_runs_through_onnx_without_llama_cpp(
    default_gguf: Path, default_model: Any, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    here = catalog.local_path(entry)
    (home / "models" / here.parent.name).mkdir()
    (home / "models" / here.parent.name / here.name).symlink_to(default_gguf)
    env = {**os.environ, "EDGEINFER_HOME": str(home)}
    argv = [sys.executable, "-c", _WITHOUT_LLAMA_CPP, "run", catalog.DEFAULT_MODEL]
    argv += ["-p", "The capital of France is", "-n", "6", "--temperature", "0", "--threads", "2"]
    first = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "building its ONNX graph once" in first.stderr
    # the greedy reply starts as llama.cpp's on the same file does (computed in this run)
    want = default_model.generate("The capital of France is", max_new_tokens=1, temperature=0)
    assert first.stdout.startswith(want.text)
    derived = list((home / "derived").glob("*-native-v*"))
    assert len(derived) == 1 and (derived[0] / "edgeinfer.json").is_file()
    again = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "building" not in again.stderr  # made once, reused
    assert again.stdout == first.stdout
