"""KV snapshots (edgeinfer.generation.state): the file format against hostile bytes, and
save_state / load_state exact on both backends and both tiny families."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.errors import SnapshotError
from edgeinfer.generation.state import snapshot
from edgeinfer.generation.state.snapshot import open_snapshot, read_header, write_snapshot

FINGERPRINT = {"model_sha256": "0" * 64, "backend": "test", "layout": {"n_ctx": 64}}


def _write(path: Path, payload: bytes = b"kv" * 50, tokens: tuple[int, ...] = (1, 2, 3)) -> int:
    return write_snapshot(path, FINGERPRINT, tokens, len(tokens), [payload])


def _header(path: Path) -> snapshot.Header:
    fd = open_snapshot(path)
    try:
        return read_header(fd, path)
    finally:
        os.close(fd)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "a.kvs"
    size = _write(path)
    assert size == path.stat().st_size
    header = _header(path)
    assert header.tokens == (1, 2, 3) and header.payload_bytes == 100
    assert header.fingerprint == FINGERPRINT
    fd = open_snapshot(path)
    try:
        reader = snapshot.PayloadReader(fd, header, path)
        buf = bytearray(100)
        reader(memoryview(buf))
        reader.verify()
    finally:
        os.close(fd)
    assert bytes(buf) == b"kv" * 50
    assert [p.name for p in tmp_path.iterdir()] == ["a.kvs"]  # no temporary file left


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_hostile_bytes_are_refused_with_one_error(tmp_path: Path, data: st.DataObject) -> None:
    """Random files, truncations and flipped bytes of a valid snapshot: SnapshotError, or (a
    flip in the payload) a checksum failure when read; never another exception."""
    good = tmp_path / "good.kvs"
    _write(good)
    raw = good.read_bytes()
    kind = data.draw(st.sampled_from(["random", "truncate", "flip", "grow"]))
    if kind == "random":
        bad = data.draw(st.binary(max_size=400))
    elif kind == "truncate":
        bad = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        bad = raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1 :]
    else:
        bad = raw + data.draw(st.binary(min_size=1, max_size=50))
    path = tmp_path / "bad.kvs"
    path.write_bytes(bad)
    with pytest.raises(SnapshotError):
        header = _header(path)
        fd = open_snapshot(path)
        try:
            reader = snapshot.PayloadReader(fd, header, path)
            reader(memoryview(bytearray(header.payload_bytes)))
            reader.verify()
        finally:
            os.close(fd)


def test_symlink_and_folder_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.kvs"
    _write(target)
    link = tmp_path / "link.kvs"
    link.symlink_to(target)
    with pytest.raises(SnapshotError, match="symlink"):
        open_snapshot(link)
    with pytest.raises(SnapshotError, match="not a regular file"):
        open_snapshot(tmp_path)


def test_a_full_disk_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    calls = []

    def full(fd: int, data: object) -> int:
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(SnapshotError, match="full disk"):
        _write(tmp_path / "a.kvs")
    assert list(tmp_path.iterdir()) == []


# -- on real engines --------------------------------------------------------------------------

_ENGINES = {
    "llama-gguf": "tiny_llama_gguf",
    "gemma-gguf": "tiny_gemma_gguf",
    "llama-onnx": "tiny_llama_onnx",
    "gemma-onnx": "tiny_gemma_onnx",
    "llama-native-onnx": "tiny_native_onnx",
}


@pytest.fixture(scope="module")
def tiny_native_onnx(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama GGUF through the native ONNX builder (a shared KV buffer)."""
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    folder = tmp_path_factory.mktemp("tiny-native") / "native"
    folder.mkdir()
    write_gguf_folder(tiny_llama_gguf, folder, max_context=256)
    return folder


@pytest.fixture(scope="module", params=sorted(_ENGINES))
def tiny_path(request: pytest.FixtureRequest) -> Path:
    pytest.importorskip("transformers", reason="needs the convert extra")
    return request.getfixturevalue(_ENGINES[request.param])


def _load(path: Path, **kw: object) -> edgeinfer.Model:
    return edgeinfer.load(path, context_length=256, threads=1, **kw)  # type: ignore[arg-type]


def _prompts(model: edgeinfer.Model) -> tuple[list[int], list[int]]:
    text = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(12))
    first = model.tokenize(text + " Question one: who are you?")[:120]
    second = first[:100] + model.tokenize(" Another question: where?", add_special=False)
    return first, second


def _next_logits(model: edgeinfer.Model, prompt: list[int]) -> tuple[np.ndarray, int]:
    """The prompt's next-token logits as the generation loop gets them (reuse rule applied)."""
    backend, history = model._backend, model._history
    n = history.reuse(backend, prompt)
    logits = np.array(backend.prefill(prompt[n:]))
    history.tokens, history.batched = list(prompt), len(prompt)
    return logits, n


@pytest.fixture
def fresh(tiny_path: Path) -> Iterator[edgeinfer.Model]:
    model = _load(tiny_path)
    yield model
    model.close()


def test_restored_prefix_gives_bit_identical_logits(tiny_path: Path, tmp_path: Path) -> None:
    """save_state after one prompt, load_state in another model: the next prompt's logits
    equal a fresh model's, bit for bit, and the prefix was not read again."""
    path = tmp_path / "s.kvs"
    with _load(tiny_path) as first_model:
        first, second = _prompts(first_model)
        first_model.generate(first, max_new_tokens=3, temperature=0)
        size = first_model.save_state(path)
    assert size == path.stat().st_size
    with _load(tiny_path) as restored:
        tokens = restored.load_state(path)
        assert first[: len(tokens)] == tokens[: len(first)]
        got, reused = _next_logits(restored, second)
    with _load(tiny_path) as fresh_model:
        want, none = _next_logits(fresh_model, second)
    # 100 shared tokens, rounded to the reuse granule; a snapshot of a model with sliding-
    # window layers on llama.cpp is cut to 96 tokens when saved and reused whole
    assert reused == 96 and none == 0
    assert np.array_equal(got, want)


def test_snapshot_of_another_model_or_settings_is_refused(
    tiny_path: Path, tiny_qwen2_gguf: Path, tmp_path: Path
) -> None:
    path = tmp_path / "s.kvs"
    with _load(tiny_path) as model:
        model.generate(_prompts(model)[0], max_new_tokens=1, temperature=0)
        model.save_state(path)
    with edgeinfer.load(tiny_path, context_length=128, threads=1) as other_ctx:
        with pytest.raises(SnapshotError, match=r"other settings.*n_ctx"):
            other_ctx.load_state(path)
        assert other_ctx.generate("hello", max_new_tokens=2).finish_reason in ("stop", "length")
    with edgeinfer.load(tiny_qwen2_gguf, context_length=256, threads=1) as other_model:
        with pytest.raises(SnapshotError, match=re.escape(str(path)) + ".*another"):
            other_model.load_state(path)


def test_load_state_of_hostile_files(tiny_path: Path, tmp_path: Path) -> None:
    """Truncated, corrupt and non-snapshot files: SnapshotError naming the file; the model
    then answers as a fresh one does."""
    good = tmp_path / "good.kvs"
    with _load(tiny_path) as model:
        first, second = _prompts(model)
        model.generate(first, max_new_tokens=1, temperature=0)
        model.save_state(good)
        want = model.generate(second, max_new_tokens=4, temperature=0).token_ids
    raw = good.read_bytes()
    bad = {
        "truncated": raw[: len(raw) - 7],
        "payload-flip": raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:],
        "text": b"hello, not a snapshot\n",
        "empty": b"",
    }
    with _load(tiny_path) as model:
        for name, data in bad.items():
            path = tmp_path / f"{name}.kvs"
            path.write_bytes(data)
            with pytest.raises(SnapshotError, match=re.escape(str(path))):
                model.load_state(path)
            assert model.generate(second, max_new_tokens=4, temperature=0).token_ids == want


def test_a_shorter_shared_prefix_after_restore_is_exact(tiny_path: Path, tmp_path: Path) -> None:
    """A prompt sharing less than the snapshot holds (70 of its tokens): still the logits of a
    fresh read (a llama.cpp snapshot with sliding-window layers is then not reused at all)."""
    path = tmp_path / "s.kvs"
    with _load(tiny_path) as first_model:
        first, _ = _prompts(first_model)
        first_model.generate(first, max_new_tokens=1, temperature=0)
        first_model.save_state(path)
        third = first[:70] + first_model.tokenize(" A third, shorter one.", add_special=False)
    with _load(tiny_path) as restored:
        restored.load_state(path)
        got, _ = _next_logits(restored, third)
    with _load(tiny_path) as fresh_model:
        want, _ = _next_logits(fresh_model, third)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("kind", ["gguf", "onnx"])
def test_a_snapshot_of_the_same_architecture_with_other_weights_is_refused(
    kind: str, tmp_path: Path
) -> None:
    """Two tiny Llamas of one architecture, shape and file size, other random weights: the
    KV of one is refused by the other (a layout check alone would take it)."""
    from .ggufgen import tiny_llama

    paths = []
    for seed in (0, 1):
        path = tiny_llama(seed=seed).write(tmp_path / f"seed{seed}.gguf")
        if kind == "onnx":
            pytest.importorskip("onnxruntime")
            from edgeinfer.converters.onnx.folder import write_gguf_folder

            folder = tmp_path / f"seed{seed}-onnx"
            folder.mkdir()
            write_gguf_folder(path, folder, max_context=256)
            path = folder
        paths.append(path)
    state = tmp_path / "s.kvs"
    with _load(paths[0]) as model:
        model.generate(_prompts(model)[0], max_new_tokens=1, temperature=0)
        model.save_state(state)
    with _load(paths[1]) as other:
        assert other._backend.info["backend"] == model._backend.info["backend"]
        with pytest.raises(SnapshotError, match=re.escape(str(state)) + ".*another model"):
            other.load_state(state)
        assert other.generate("hello", max_new_tokens=2).finish_reason in ("stop", "length")
    with _load(paths[0]) as same:
        assert same.load_state(state)  # the weights it was made from still take it


def test_a_float32_llama_cpp_cache_round_trips(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """A float32 llama.cpp cache is counted at 4 bytes an element (the plan's size, the KV
    state's, model.info's), and its snapshot is taken back and restores exactly."""
    path = tmp_path / "f32.kvs"
    with _load(tiny_llama_gguf, kv_dtype="float32") as f32, _load(tiny_llama_gguf) as f16:
        per_token = f32._backend.kv_state().bytes_per_token
        assert per_token == 2 * f16._backend.kv_state().bytes_per_token
        assert f32.info["kv_cache_bytes"] == 2 * f16.info["kv_cache_bytes"]
        assert f32.info["kv_cache_bytes"] == per_token * f32.context_length
        first, second = _prompts(f32)
        f32.generate(first, max_new_tokens=3, temperature=0)
        f32.save_state(path)
    with _load(tiny_llama_gguf, kv_dtype="float32") as restored:
        restored.load_state(path)
        got, reused = _next_logits(restored, second)
    with _load(tiny_llama_gguf, kv_dtype="float32") as fresh_model:
        want, _ = _next_logits(fresh_model, second)
    assert reused == 96 and np.array_equal(got, want)


@pytest.mark.parametrize("kind", ["llama-gguf", "llama-native-onnx"])
def test_snapshots_at_parallel_2_hold_the_last_sequence(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """At parallel > 1 save_state writes the sequence of the last request to end (taken
    between two engine steps) and load_state reads one into a free slot, which the next
    prompt that starts with its tokens reuses: it answers as a fresh model does."""
    model_path = request.getfixturevalue(_ENGINES[kind])
    path = tmp_path / "p2.kvs"
    with _load(model_path, parallel=2) as model:
        first, second = _prompts(model)
        with pytest.raises(edgeinfer.InvalidRequestError, match="no sequence"):
            model.save_state(path)
        model.generate(first, max_new_tokens=3, temperature=0)
        assert model.save_state(path) == path.stat().st_size
        stream = model.stream(second, max_new_tokens=64, temperature=0)
        next(stream)  # the slot of the last sequence now serves this request
        with pytest.raises(edgeinfer.ModelBusyError, match="serves a request"):
            model.save_state(tmp_path / "busy.kvs")
        stream.cancel()
        stream.collect()
    with _load(model_path, parallel=2) as restored:
        tokens = restored.load_state(path)
        assert tokens[: len(first)] == first  # the prompt and the tokens decoded after it
        got = restored.generate(second, max_new_tokens=8, temperature=0)
    with _load(model_path, parallel=2) as fresh_model:
        want = fresh_model.generate(second, max_new_tokens=8, temperature=0)
    assert got.stats.reused_prompt_tokens == 96 and want.stats.reused_prompt_tokens == 0
    assert got.token_ids == want.token_ids
