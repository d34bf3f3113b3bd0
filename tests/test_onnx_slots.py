"""Sequence slots on the ONNX backend: the native builder's graphs take a batch axis, one KV
allocation holds a row per slot, and ``decode_many`` appends one token to several slots in one
run. Each slot must compute what the same sequence computes alone in a one-slot backend, a slot
left out of a step must keep its cache, and graphs built for one sequence are refused at
``parallel > 1``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.config import LoadConfig
from edgeinfer.errors import InvalidRequestError, ModelLoadError
from edgeinfer.files.manifest import Manifest
from edgeinfer.machine.policy import Candidate

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgeinfer.runtimes.onnxruntime import OrtBackend, open_backend  # noqa: E402

_CPU = Candidate("CPUExecutionProvider", "cpu", "test")
_CTX = 64
Opener = Callable[..., OrtBackend]


def _native(gguf: Path, out: Path) -> Path:
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    out.mkdir()
    write_gguf_folder(gguf, out, max_context=_CTX)
    return out


@pytest.fixture(scope="module")
def llama_folder(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _native(tiny_llama_gguf, tmp_path_factory.mktemp("slots") / "llama")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, and the tiny Gemma 3 (its sliding-window layers read per-row lengths
    too; 16-token window, so the prompts below cross it)."""
    if request.param == "llama":
        return request.getfixturevalue("llama_folder")
    gguf = request.getfixturevalue("tiny_gemma_gguf")
    return _native(gguf, tmp_path_factory.mktemp("slots") / "gemma3")


def _opener(folder: Path) -> Opener:
    def open_(parallel: int = 1, manifest: Manifest | None = None) -> OrtBackend:
        config = LoadConfig(context_length=_CTX, threads=1, parallel=parallel)
        return open_backend(folder, config, manifest or Manifest.read(folder), _CPU)

    return open_


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [19, 5, 11, 1, 23, 8, 2, 14][:n]
    return [[int(t) for t in rng.integers(3, 250, size)] for size in lengths]


def _alone(open_: Opener, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    """Logits of ``prompt`` then each of ``steps``, the sequence alone in a one-slot backend."""
    one = open_(1)
    try:
        out = [one.prefill(prompt).copy()]
        return out + [one.decode(t).copy() for t in steps]
    finally:
        one.close()


def _close(got: np.ndarray, want: np.ndarray) -> None:
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_each_slot_computes_what_the_sequence_computes_alone(folder: Path) -> None:
    open_ = _opener(folder)
    prompts = _prompts(4)
    steps = [7, 99, 3]
    many = open_(4)
    for slot in (2, 0, 3, 1):  # the other slots hold other sequences meanwhile
        many.prefill(prompts[(slot + 1) % 4], (slot + 1) % 4)
        many.rewind(0, slot)
        got = [many.prefill(prompts[slot], slot).copy()]
        got += [many.decode(t, slot).copy() for t in steps]
        for g, w in zip(got, _alone(open_, prompts[slot], steps), strict=True):
            _close(g, w)
        assert many.slot_past(slot) == len(prompts[slot]) + len(steps)


def test_decode_many_matches_each_sequence_alone(folder: Path) -> None:
    """Four sequences of different lengths in slots that are not neighbours (idle slots
    between them, one of them holding a sequence), listed out of slot order."""
    open_ = _opener(folder)
    prompts = _prompts(4, seed=1)
    slots = [4, 1, 2, 6]
    rng = np.random.default_rng(2)
    tokens = [[int(t) for t in rng.integers(3, 250, 5)] for _ in slots]
    many = open_(8)
    for slot, prompt in zip(slots, prompts, strict=True):
        _close(many.prefill(prompt, slot), _alone(open_, prompt, [])[0])
    many.prefill([9, 8, 7], 3)  # idle, inside the span
    want = [_alone(open_, p, t) for p, t in zip(prompts, tokens, strict=True)]
    for i in range(5):
        out = many.decode_many([(s, t[i]) for s, t in zip(slots, tokens, strict=True)])
        assert out.shape == (4, many.tokenizer.n_vocab) and out.dtype == np.float32
        for row, w in zip(out, want, strict=True):
            _close(row, w[i + 1])
    for slot, prompt in zip(slots, prompts, strict=True):
        assert many.slot_past(slot) == len(prompt) + 5
    assert [many.slot_past(s) for s in (0, 3, 5, 7)] == [0, 3, 0, 0]


def test_a_slot_left_out_of_steps_keeps_its_cache(llama_folder: Path) -> None:
    """Slot 2 sits between slots decoding together (a padding row of their run), even with a
    full context; its next decode is what it would be without the interleaved steps."""
    open_ = _opener(llama_folder)
    kept = _prompts(1, seed=3)[0] * 4  # 76 tokens: cut to the full context below
    kept = kept[: _CTX - 1]
    want = _alone(open_, kept, [42])[1]
    many = open_(4)
    many.prefill([*kept, 42], 2)  # full
    assert many.slot_past(2) == _CTX
    many.prefill([5, 6, 7], 1)
    many.prefill([8], 3)
    for t in (11, 12, 13):
        many.decode_many([(3, t), (1, t)])
    many.rewind(_CTX - 1, 2)
    _close(many.decode(42, 2), want)


def test_rewind_is_per_slot(llama_folder: Path) -> None:
    open_ = _opener(llama_folder)
    prompt = _prompts(1, seed=4)[0]
    many = open_(3)
    many.prefill(prompt, 1)
    many.prefill(prompt, 2)
    many.rewind(6, 1)
    assert (many.slot_past(1), many.slot_past(2)) == (6, len(prompt))
    _close(many.prefill([50, 51], 1), _alone(open_, [*prompt[:6], 50, 51], [])[0])
    _close(many.decode(60, 2), _alone(open_, prompt, [60])[1])
    with pytest.raises(InvalidRequestError, match="cannot rewind"):
        many.rewind(9, 1)  # slot 1 holds 8


@pytest.mark.parametrize("slot", [-1, 3, 7, True, 1.0, "0", None])
def test_a_slot_that_is_not_one_is_refused(llama_folder: Path, slot: object) -> None:
    many = _opener(llama_folder)(3)
    calls: list[Callable[[], object]] = [
        lambda: many.prefill([5], slot),  # type: ignore[arg-type]
        lambda: many.decode(5, slot),  # type: ignore[arg-type]
        lambda: many.rewind(0, slot),  # type: ignore[arg-type]
        lambda: many.slot_past(slot),  # type: ignore[arg-type]
        lambda: many.decode_many([(0, 5), (slot, 5)]),  # type: ignore[list-item]
    ]
    for call in calls:
        with pytest.raises(InvalidRequestError, match="slot"):
            call()
    assert [many.slot_past(s) for s in range(3)] == [0, 0, 0]


def test_bad_steps_are_refused_before_anything_runs(llama_folder: Path) -> None:
    many = _opener(llama_folder)(3)
    many.prefill(list(range(3, 3 + _CTX)), 2)  # full
    many.prefill([5], 0)
    bad = [[], [(0, 5), (0, 6)], [(0, 5), (2, 6)], [(0, 5), 7], [(0, 5, 1)], "ab"]
    for steps in bad:
        with pytest.raises(InvalidRequestError):
            many.decode_many(steps)  # type: ignore[arg-type]
    assert [many.slot_past(s) for s in range(3)] == [1, 0, _CTX]


def test_kv_nbytes_counts_every_slot(llama_folder: Path) -> None:
    open_ = _opener(llama_folder)
    one, many = open_(1), open_(5)
    assert many.n_slots == 5 and one.n_slots == 1
    assert many.kv_nbytes == 5 * one.kv_nbytes
    assert many.n_ctx == one.n_ctx == _CTX
    assert many.info["slots"] == 5


def _fixed_batch_copy(folder: Path, out: Path) -> Path:
    """``folder`` with its graph's batch axis fixed at 1, as the builder wrote graphs before
    sequence slots."""
    import shutil

    out.mkdir()
    for f in folder.iterdir():
        if f.name != "model.onnx":
            shutil.copy2(f, out / f.name)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        dims[0].Clear()
        dims[0].dim_value = 1
    onnx.save(model, str(out / "model.onnx"))
    return out


def test_a_graph_built_for_one_sequence_is_refused_at_parallel(
    llama_folder: Path, tmp_path: Path
) -> None:
    old = _fixed_batch_copy(llama_folder, tmp_path / "old")
    with pytest.raises(ModelLoadError, match="re-convert"):
        _opener(old)(2)
    prompt = _prompts(1)[0]
    got = _alone(_opener(old), prompt, [7, 8])  # parallel=1 as before
    for g, w in zip(got, _alone(_opener(llama_folder), prompt, [7, 8]), strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_growing_cache_is_refused_at_parallel(llama_folder: Path) -> None:
    manifest = Manifest.read(llama_folder)
    arch = dataclasses.replace(manifest.architecture, kv_cache="grow")
    grow = dataclasses.replace(manifest, architecture=arch)
    with pytest.raises(ModelLoadError, match="parallel=1"):
        _opener(llama_folder)(2, grow)
    one = _opener(llama_folder)(1, grow)  # one sequence: the cache grows as before
    prompt = _prompts(1)[0]
    got = [one.prefill(prompt).copy(), one.decode(7).copy()]
    for g, w in zip(got, _alone(_opener(llama_folder), prompt, [7]), strict=True):
        _close(g, w)


def test_a_genai_folder_with_a_batch_axis_loads_with_slots(
    llama_folder: Path, tmp_path: Path
) -> None:
    """onnxruntime-genai's layout (no edgeinfer.json) over a graph with a batch axis and a
    shared buffer: slots work; with a growing cache they are refused."""
    import json
    import shutil

    from edgeinfer.files.genai_folder import manifest_from_genai_folder

    from .test_genai_folder import _genai_config

    folder = tmp_path / "genai"
    folder.mkdir()
    for name in ("model.onnx", "model.onnx.data", "tokenizer.json"):
        shutil.copy2(llama_folder / name, folder / name)
    gguf = Path(Manifest.read(llama_folder).source["path"])
    for share in (True, False):
        config = _genai_config(gguf, share=share)
        config["model"]["context_length"] = _CTX  # type: ignore[index]
        (folder / "genai_config.json").write_text(json.dumps(config))
        manifest = manifest_from_genai_folder(folder)
        if not share:
            with pytest.raises(ModelLoadError, match="grows the cache"):
                _opener(folder)(2, manifest)
            continue
        many = _opener(folder)(3, manifest)
        prompts = _prompts(2, seed=5)
        for slot, prompt in zip((0, 2), prompts, strict=True):
            many.prefill(prompt, slot)
        out = many.decode_many([(2, 9), (0, 8)])
        _close(out[0], _alone(_opener(llama_folder), prompts[1], [9])[1])
        _close(out[1], _alone(_opener(llama_folder), prompts[0], [8])[1])


@pytest.fixture(scope="module")
def shared_many(llama_folder: Path) -> OrtBackend:
    return _opener(llama_folder)(4)


_STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.one_of(st.integers(-2, 5), st.booleans(), st.none(), st.text(max_size=2)),
            st.one_of(st.integers(-1, 500), st.none(), st.booleans(), st.floats()),
        ),
        st.integers(),
        st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(0, 9)),
    ),
    max_size=6,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=_STEPS, fill=st.lists(st.sampled_from([0, 1, 7, _CTX - 1, _CTX]), min_size=4, max_size=4)
)
def test_any_steps_either_run_or_change_nothing(
    shared_many: OrtBackend, steps: list[tuple[object, object]], fill: list[int]
) -> None:
    """Hypothesis over decode_many's argument: a refused step list is an InvalidRequestError
    that leaves every slot as it was; an accepted one appends one token to each listed slot
    and to no other."""
    many = shared_many
    for slot, length in enumerate(fill):
        many.rewind(0, slot)
        if length:
            many.prefill([3] * length, slot)
    try:
        out = many.decode_many(steps)  # type: ignore[arg-type]
    except InvalidRequestError:
        assert [many.slot_past(s) for s in range(4)] == fill
        return
    listed = {s for s, _ in steps}  # type: ignore[misc]
    assert out.shape == (len(steps), many.tokenizer.n_vocab)
    assert np.isfinite(out).all()
    for slot in range(4):
        assert many.slot_past(slot) == fill[slot] + (slot in listed)


@pytest.mark.model
def test_default_model_batched_greedy_tokens_agree_with_alone(default_gguf: Path) -> None:
    """The default model's transcode (4-bit blocks, MatMulNBits with int8 activations): the
    same contexts decoded four at a time pick the token they pick alone, or a near tie.
    Not bit-exact: a one-row run takes another MatMulNBits kernel than a run of several rows,
    and the int8 rounding of activations turns its last-bit differences into larger ones."""
    from edgeinfer.files import catalog
    from edgeinfer.files.source import resolve
    from edgeinfer.loader import transcoded_catalog_model

    folder = transcoded_catalog_model(resolve(catalog.DEFAULT_MODEL)).path
    config = LoadConfig(context_length=256, threads=2, parallel=4)
    many = open_backend(folder, config, Manifest.read(folder), _CPU)
    one = open_backend(folder, dataclasses.replace(config, parallel=1), Manifest.read(folder), _CPU)
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
    prompts = [many.tokenizer.encode(t) for t in texts]
    alone: list[list[np.ndarray]] = []
    tokens: list[list[int]] = []
    for prompt in prompts:  # greedy alone; its tokens are fed to the batch too
        one.rewind(0)
        logits = [one.prefill(prompt).copy()]
        for _ in range(12):
            logits.append(one.decode(int(np.argmax(logits[-1]))).copy())
        alone.append(logits)
        tokens.append([int(np.argmax(x)) for x in logits[:-1]])
    for slot, prompt in enumerate(prompts):
        many.prefill(prompt, slot)
    agree = 0
    for i in range(12):
        out = many.decode_many([(s, tokens[s][i]) for s in range(4)])
        for s in range(4):
            want = alone[s][i + 1]
            choice = int(np.argmax(out[s]))
            agree += choice == int(np.argmax(want))
            assert want[choice] >= want.max() - 0.1 * float(np.abs(want).max())
    assert agree >= 0.8 * 48
