"""A transcode stops where its source stops: the end-of-generation set edgeinfer computes from
a GGUF's metadata (``edgeinfer.files.gguf_eog``) is the set llama.cpp stops on, asked of llama.cpp
for every id, on hypothesis-drawn vocabularies, on each tiny family (a Qwen2 vocabulary with
the Qwen2.5-Coder fill-in-the-middle tokens among them) and on the default catalog model; the
folder a conversion writes carries it, and the ONNX route stops on it as the GGUF route does."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.cli import main as cli_main
from edgeinfer.files.gguf_checks import check_gguf_model
from edgeinfer.files.gguf_eog import EOG_TEXTS, end_of_generation_ids
from edgeinfer.files.gguf_file import read_gguf_header

from . import ggufgen
from .ggufgen import ARRAY, I32, STRING, U32, Value

pytest.importorskip("llama_cpp", reason="needs the gguf extra: llama.cpp is the reference")

_CONTROL, _NORMAL, _USER_DEFINED = 3, 1, 4
# Qwen2.5-Coder's fill-in-the-middle tokens: llama.cpp stops on the pad, repo-name and
# file-separator ones, not on the prefix, middle and suffix ones
QWEN_CODER_TOKENS = (
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
_FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_SPECIAL_KEYS = ("eos", "eot", "eom", *_FIM_TEXTS)


def llama_cpp_eog(gguf: Path) -> set[int]:
    """llama.cpp's own answer: every id ``llama_vocab_is_eog`` is true for."""
    from edgeinfer.runtimes.llama_cpp import engine

    llama_cpp = engine()
    ref = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(ref.model)
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        return {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    finally:
        ref.close()


def ours(gguf: Path) -> set[int]:
    header = read_gguf_header(gguf, whole_arrays=("tokenizer.ggml.tokens",))
    tokens = [str(t) for t in header.metadata["tokenizer.ggml.tokens"]]
    return set(end_of_generation_ids(header.metadata, tokens))


def route_stop_set(path: Path) -> set[int]:
    """The ids a loaded model (either route) ends a generation on."""
    with edgeinfer.load(path, context_length=64, threads=1) as model:
        tokenizer = model._tokenizer
        return {t for t in range(model.info["vocab_size"]) if tokenizer.is_end_of_generation(t)}


# -- drawn vocabularies against llama.cpp --------------------------------------------------

_LOOKALIKES = ("<|im_end|> ", "<|IM_END|>", "<|eot|>", "im_end", "<|end", "</s >", "<s>")
_TEXT = st.sampled_from(
    sorted(EOG_TEXTS) + [t for group in _FIM_TEXTS.values() for t in group] + list(_LOOKALIKES)
) | st.text(st.sampled_from("<|>_abEOT/s"), min_size=1, max_size=8)
_ID = st.none() | st.integers(0, 400)  # past the vocabulary too (it has ~280 tokens)
_BASE = frozenset(ggufgen.tiny_llama(hidden=8, heads=2, kv_heads=1, layers=1, ffn=16)
                  .metadata["tokenizer.ggml.tokens"].value[1])  # fmt: skip


@st.composite
def _vocabularies(draw: st.DrawFn) -> tuple[str, list[tuple[str, int]], dict[str, int]]:
    model = draw(st.sampled_from(["gpt2", "llama"]))
    kinds = st.sampled_from([_NORMAL, _CONTROL, _USER_DEFINED])
    # unique texts, none of the base vocabulary's: llama.cpp aborts on a repeated token (the
    # file checks refuse one before it is loaded)
    extra = draw(
        st.lists(st.tuples(_TEXT.filter(lambda t: t not in _BASE), kinds), unique_by=lambda x: x[0])
    )
    ids = {key: draw(_ID) for key in _SPECIAL_KEYS}
    return model, extra, {k: v for k, v in ids.items() if v is not None}


def _drawn_gguf(path: Path, model: str, extra: list[tuple[str, int]], ids: dict[str, int]) -> Path:
    tiny = ggufgen.tiny_llama(hidden=8, heads=2, kv_heads=1, layers=1, ffn=16)
    meta = tiny.metadata
    tokens = list(meta["tokenizer.ggml.tokens"].value[1]) + [t for t, _ in extra]
    types = list(meta["tokenizer.ggml.token_type"].value[1]) + [k for _, k in extra]
    meta["tokenizer.ggml.model"] = Value(STRING, model)
    meta["tokenizer.ggml.tokens"] = Value(ARRAY, (STRING, tokens))
    meta["tokenizer.ggml.token_type"] = Value(ARRAY, (I32, types))
    del meta["tokenizer.ggml.eos_token_id"]
    for key, value in ids.items():
        meta[f"tokenizer.ggml.{key}_token_id"] = Value(U32, value)
    embedding = np.zeros((len(tokens), 8), np.float32)
    tiny.tensors[0] = ggufgen.Tensor("token_embd.weight", (8, len(tokens)), embedding.tobytes())
    tiny.write(path)
    check_gguf_model(read_gguf_header(path))  # what llama.cpp would abort on is refused first
    return path


def _ambiguous(tokens: list[str], ids: dict[str, int]) -> set[int]:
    """The ids of a fill-in-the-middle kind the metadata leaves unnamed and two or more texts
    claim: llama.cpp takes one of them in its hash map's order, edgeinfer all."""
    last = {text: i for i, text in enumerate(tokens)}
    claimed: set[int] = set()
    for key, texts in _FIM_TEXTS.items():
        if key in ids and ids[key] < len(tokens):
            continue
        found = {last[t] for t in texts if t in last}
        if len(found) > 1:
            claimed |= found
    return claimed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=_vocabularies())
def test_the_set_is_llama_cpps_on_drawn_vocabularies(
    drawn: tuple[str, list[tuple[str, int]], dict[str, int]],
) -> None:
    model, extra, ids = drawn
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _drawn_gguf(Path(tmp) / "drawn.gguf", model, extra, ids)
        theirs, mine = llama_cpp_eog(gguf), ours(gguf)
        tokens = [str(t) for t in read_gguf_header(gguf, whole_arrays=("tokenizer.ggml.tokens",))
                  .metadata["tokenizer.ggml.tokens"]]  # fmt: skip
    ambiguous = _ambiguous(tokens, ids)
    assert theirs <= mine and mine - theirs <= ambiguous, (
        sorted(mine - theirs),
        sorted(theirs - mine),
        [tokens[i] for i in sorted(mine ^ theirs)],
    )


def test_named_cases_match_llama_cpp(tmp_path: Path) -> None:
    """The rules one at a time: a gpt2 vocabulary without an eos id ends on id 11 (llama.cpp's
    default), an out-of-range eos falls back to it, a normal-typed ``<|im_end|>`` still ends,
    ``<|end|>`` does not beside ``<|return|>`` and ``<|call|>``, a metadata id ends whatever
    its text, a metadata fill-in-the-middle id wins over the texts."""
    cases = [
        ("gpt2", [], {}),
        ("gpt2", [], {"eos": 999}),
        ("llama", [], {}),
        ("gpt2", [("<|im_end|>", _NORMAL), ("<|file_sep|>", _USER_DEFINED)], {}),
        ("gpt2", [("<|end|>", _CONTROL), ("<|return|>", _CONTROL), ("<|call|>", _CONTROL)], {}),
        ("gpt2", [("<|end|>", _CONTROL), ("<|return|>", _CONTROL)], {}),
        ("gpt2", [("<|im_end|>", _CONTROL)], {"eos": 5, "eot": 5, "eom": 300}),
        ("gpt2", [("</s>", _CONTROL), ("<|tool_response>", _CONTROL)], {"eot": 300}),
        ("llama", [("<|fim_pad|>", _CONTROL), ("<PAD>", _CONTROL)], {"fim_pad": 3}),
    ]
    for i, (model, extra, ids) in enumerate(cases):
        gguf = _drawn_gguf(tmp_path / f"case{i}.gguf", model, extra, ids)
        assert ours(gguf) == llama_cpp_eog(gguf), (model, extra, ids)


# -- the tiny families and a catalog model: the folder and both routes ----------------------


def _with_tokens(src: Path, dst: Path, added: tuple[str, ...]) -> Path:
    """``src`` with the control tokens ``added`` appended to its vocabulary (their embedding
    and output rows random), every other value and tensor as it was."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    meta: dict[str, Value] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        types = [int(t) for t in field.types]
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            value = [*value, *added]
        elif name == "tokenizer.ggml.token_type":
            value = [*value, *[_CONTROL] * len(added)]
        elif name == "tokenizer.ggml.scores":
            value = [*value, *[0.0] * len(added)]
        meta[name] = (
            Value(ARRAY, (types[1], value)) if types[0] == ARRAY else Value(types[0], value)
        )
    rng = np.random.default_rng(0)
    tensors = []
    for t in reader.tensors:
        data = np.asarray(t.data)
        shape = tuple(int(d) for d in t.shape)
        if t.name in ("token_embd.weight", "output.weight"):
            rows = rng.standard_normal((len(added), data.shape[1])).astype(data.dtype)
            data = np.concatenate([data, rows])
            shape = (shape[0], shape[1] + len(added))
        tensors.append(ggufgen.Tensor(t.name, shape, data.tobytes(), int(t.tensor_type)))
    return ggufgen.Model(meta, tensors).write(dst)


@pytest.fixture(scope="module")
def qwen_coder_gguf(tiny_qwen2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with Qwen2.5-Coder's fill-in-the-middle tokens in its vocabulary."""
    pytest.importorskip("gguf", reason="needs the convert extra")
    out = tmp_path_factory.mktemp("qwen-coder") / "tiny-qwen2-coder-f32.gguf"
    return _with_tokens(tiny_qwen2_gguf, out, QWEN_CODER_TOKENS)


_GGUFS = {"llama": "tiny_llama_gguf", "qwen2-coder": "qwen_coder_gguf", "gemma3": "tiny_gemma_gguf"}


@pytest.fixture(scope="module", params=sorted(_GGUFS))
def family_gguf(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(_GGUFS[request.param]))


@pytest.fixture(scope="module")
def family_folder(family_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The folder ``edgeinfer convert`` writes for the family's GGUF (native builder,
    validated against llama.cpp on the source)."""
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters import convert

    out = tmp_path_factory.mktemp("stops") / family_gguf.stem
    convert(family_gguf, out, threads=1)
    yield out


def test_the_folder_carries_llama_cpps_set_and_both_routes_stop_on_it(
    family_gguf: Path, family_folder: Path
) -> None:
    expected = llama_cpp_eog(family_gguf)
    manifest = json.loads((family_folder / "edgeinfer.json").read_text())
    assert set(manifest["eos_token_ids"]) == expected
    assert manifest["validation"]["tokenizer_check"]["stop_ids"] == {
        "ids": sorted(expected),
        "checked_against": "llama.cpp",
    }
    assert route_stop_set(family_gguf) == expected  # the GGUF route: llama.cpp itself
    assert route_stop_set(family_folder) == expected  # the ONNX route: the manifest


def test_qwen_coder_tokens_that_end_a_generation_are_in_the_set(qwen_coder_gguf: Path) -> None:
    """What makes the Qwen2 case meaningful: the pad, repo-name and file-separator tokens end
    a generation in llama.cpp (on top of ``<|endoftext|>`` and ``<|im_end|>``)."""
    header = read_gguf_header(qwen_coder_gguf, whole_arrays=("tokenizer.ggml.tokens",))
    tokens = [str(t) for t in header.metadata["tokenizer.ggml.tokens"]]
    stops = {tokens[i] for i in llama_cpp_eog(qwen_coder_gguf)}
    assert {"<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|im_end|>"} <= stops
    assert stops == {tokens[i] for i in ours(qwen_coder_gguf)}


@pytest.mark.parametrize("route", ["gguf", "onnx"])
def test_a_generation_forced_onto_the_file_separator_stops_on_both_routes(
    qwen_coder_gguf: Path, tmp_path_factory: pytest.TempPathFactory, route: str
) -> None:
    """The reported run: a reply pushed onto ``<|file_sep|>`` ends there with no token on
    either route (the ONNX route used to run on to ``length``)."""
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters import convert

    path = qwen_coder_gguf
    if route == "onnx":
        path = tmp_path_factory.mktemp("forced") / "onnx"
        convert(qwen_coder_gguf, path, threads=1)
    with edgeinfer.load(path, context_length=64, threads=1) as model:
        (sep,) = model.tokenize("<|file_sep|>", add_special=False)
        result = model.generate(
            "def add(a, b):", max_new_tokens=8, temperature=0, logit_bias={sep: 1e4}
        )
    assert (result.finish_reason, result.token_ids) == ("stop", ())


@pytest.mark.model
def test_the_default_catalog_model_stops_alike_on_both_routes(
    default_gguf: Path, tmp_path: Path
) -> None:
    """SmolLM2's ``<reponame>`` ends a generation in llama.cpp: the folder stops on it too."""
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    expected = llama_cpp_eog(default_gguf)
    assert ours(default_gguf) == expected
    folder = tmp_path / "smollm2"
    folder.mkdir()
    manifest, _ = write_gguf_folder(default_gguf, folder, max_context=256)
    assert set(manifest.eos_token_ids) == expected
    assert route_stop_set(folder) == expected == route_stop_set(default_gguf)


def test_a_folder_that_would_stop_elsewhere_is_refused_in_one_line(
    tiny_llama_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A stop set that drifts from llama.cpp's (here: none at all) fails the conversion with
    one ``edgeinfer: error:`` line, and nothing is written."""
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters.onnx import vocab

    monkeypatch.setattr(vocab, "end_of_generation_ids", lambda meta, tokens: ())
    out = tmp_path / "drifted"
    assert cli_main(["convert", str(tiny_llama_gguf), "-o", str(out), "--threads", "1"]) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("edgeinfer: error: ") and "run past tokens" in lines[-1]
    assert "Traceback" not in "\n".join(lines)
    assert not out.exists() and not list(tmp_path.glob(".drifted*"))
