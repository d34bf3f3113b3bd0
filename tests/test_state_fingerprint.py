"""What a snapshot's fingerprint holds, shown by restores it must refuse: other weights of the
same architecture (also a model file rewritten in place to the same size with its mtime put
back), another SIMD family or engine build; and what it leaves out on purpose (the thread
count: the same bits at any count, checked here on both engines)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.errors import SnapshotError
from edgeinfer.generation.state import fingerprint
from edgeinfer.generation.state.snapshot import open_snapshot, read_header, write_snapshot

from .ggufgen import tiny_llama

PROMPT = "Rule one: answer briefly and kindly. Rule two: be exact. " * 3


@pytest.fixture(scope="module")
def two_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny Llamas of one architecture and size, other random weights."""
    folder = tmp_path_factory.mktemp("two-weights")
    a = tiny_llama(seed=0).write(folder / "a.gguf")
    b = tiny_llama(seed=1).write(folder / "b.gguf")
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    return a, b


def _load(path: Path, threads: int = 1) -> edgeinfer.Model:
    return edgeinfer.load(path, context_length=256, threads=threads)


def _save(model_path: Path, state: Path) -> None:
    with _load(model_path) as model:
        model.generate(PROMPT, max_new_tokens=2, temperature=0)
        model.save_state(state)


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` (the same size) in the same inode, its mtime put back."""
    before = path.stat()
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    same = ("st_ino", "st_dev", "st_size", "st_mtime_ns")
    assert all(getattr(after, k) == getattr(before, k) for k in same)
    assert after.st_ctime_ns != before.st_ctime_ns  # what the kernel alone sets


@pytest.mark.parametrize("remembered", ["in this process", "on disk"])
def test_a_model_rewritten_in_place_with_its_mtime_put_back_is_hashed_again(
    two_weights: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remembered: str
) -> None:
    """The snapshot of the old weights is refused on the new ones: same path, inode, size and
    mtime; the sha256 remembered for them (in memory, or under $EDGEINFER_HOME) is not used."""
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    model, state = tmp_path / "model.gguf", tmp_path / "s.kvs"
    shutil.copyfile(two_weights[0], model)
    _save(model, state)
    old = fingerprint.file_sha256(model)
    _rewrite_in_place(model, two_weights[1].read_bytes())
    if remembered == "on disk":  # a new process: only the record under $EDGEINFER_HOME
        monkeypatch.setattr(fingerprint, "_known", {})
        assert list((tmp_path / "home" / "cache" / "sha256").glob("*.json"))
    assert fingerprint.file_sha256(model) == fingerprint.file_sha256(two_weights[1]) != old
    with _load(model) as replaced:
        with pytest.raises(SnapshotError, match=r"another model \(its sha256 differs"):
            replaced.load_state(state)


def test_an_untouched_model_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    path = tmp_path / "w.bin"
    path.write_bytes(b"weights" * 1000)
    first = fingerprint.file_sha256(path)
    calls = []
    real = fingerprint.hashlib.sha256
    monkeypatch.setattr(fingerprint.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    assert fingerprint.file_sha256(path) == first and calls == []


def _retagged(state: Path, out: Path, **changes: str) -> Path:
    """A copy of ``state`` whose fingerprint says ``changes`` (a valid file otherwise)."""
    fd = open_snapshot(state)
    try:
        header = read_header(fd, state)
    finally:
        os.close(fd)
    payload = state.read_bytes()[header.payload_offset :]
    fp = {**header.fingerprint, **changes}
    write_snapshot(out, fp, header.tokens, header.reusable, [payload])
    return out


@pytest.mark.parametrize(
    ("field", "value"),
    [("simd", "arm64/neon"), ("cpu_features", "neon"), ("engine_build", "CPU : NEON = 1 |"),
     ("engine_version", "0.0.1")],
)  # fmt: skip
def test_a_snapshot_of_another_machine_or_engine_build_is_refused_naming_the_field(
    tiny_llama_gguf: Path, tmp_path: Path, field: str, value: str
) -> None:
    state = tmp_path / "s.kvs"
    _save(tiny_llama_gguf, state)
    with _load(tiny_llama_gguf) as model:
        model.load_state(state)  # the real file restores
        ours = model._states.fingerprint[field]  # type: ignore[union-attr]
        other = _retagged(state, tmp_path / "other.kvs", **{field: value})
        with pytest.raises(SnapshotError) as caught:
            model.load_state(other)
    message = str(caught.value)
    assert f"another {field}:" in message and str(other) in message
    assert f"the file's {value!r}" in message and f"this machine's {ours!r:.200}" in message


def test_this_machine_with_another_simd_family_refuses_a_snapshot_made_here(
    tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same file, read by 'another machine' (the inventory says NEON): refused."""
    state = tmp_path / "s.kvs"
    _save(tiny_path, state)
    here = fingerprint.machine()["simd"]
    monkeypatch.setattr(fingerprint, "machine", lambda: {"simd": "arm64/neon", "cpu_features": ""})
    with _load(tiny_path) as model:
        with pytest.raises(SnapshotError, match="another simd") as caught:
            model.load_state(state)
    assert f"the file's {here!r}" in str(caught.value) and "'arm64/neon'" in str(caught.value)


@pytest.fixture(scope="module", params=["gguf", "onnx"])
def tiny_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama wide enough that its products are split between threads."""
    folder = tmp_path_factory.mktemp("wide")
    gguf = tiny_llama(hidden=256, heads=8, kv_heads=4, ffn=768, seed=5).write(folder / "w.gguf")
    if request.param == "gguf":
        return gguf
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    out = folder / "onnx"
    out.mkdir()
    write_gguf_folder(gguf, out, max_context=256)
    return out


def _next_logits(model: edgeinfer.Model, prompt: list[int]) -> np.ndarray:
    n = model._history.reuse(model._backend, prompt)
    return np.array(model._backend.prefill(prompt[n:]))


def test_the_thread_count_changes_no_bit_so_it_is_not_in_the_fingerprint(
    tiny_path: Path, tmp_path: Path
) -> None:
    """A snapshot made with 1 thread restores into a model of 2 and gives the logits a fresh
    1-thread model gives, bit for bit; and the fingerprints of 1 and 2 threads are equal."""
    state = tmp_path / "s.kvs"
    with _load(tiny_path, threads=1) as one:
        prompt = one.tokenize(PROMPT)[:150]
        one.generate(prompt[:120], max_new_tokens=1, temperature=0)
        one.save_state(state)
        want = _next_logits(one, prompt)
    with _load(tiny_path, threads=2) as two:
        assert two.info["threads"] == 2
        two.load_state(state)
        got = _next_logits(two, prompt)
        theirs = two._states.fingerprint  # type: ignore[union-attr]
    with _load(tiny_path, threads=2) as fresh:
        assert np.array_equal(_next_logits(fresh, prompt), want)
    assert np.array_equal(got, want)
    with _load(tiny_path, threads=1) as again:
        again.load_state(state)
        assert again._states.fingerprint == theirs  # type: ignore[union-attr]


_X86 = ["sse4.2", "avx", "avx2", "fma", "f16c", "avx-vnni", "avx512f", "avx512bw", "amx"]
_ARM = ["neon", "fp16", "dotprod", "i8mm", "bf16", "sve", "sve2"]


@settings(max_examples=200, deadline=None)
@given(
    arch=st.sampled_from(["x86_64", "arm64", "riscv64", ""]),
    features=st.lists(st.sampled_from(_X86 + _ARM) | st.text(max_size=8), max_size=12),
)
def test_the_simd_family_is_the_widest_vector_set(arch: str, features: list[str]) -> None:
    family = fingerprint.simd_family(arch, features)
    assert family == fingerprint.simd_family(arch, list(reversed(features)))
    prefix, _, name = family.partition("/")
    assert prefix == arch
    if arch == "x86_64":
        widest = next((f for f in ("avx512f", "avx2", "avx", "sse4.2") if f in features), None)
        assert name == {"avx512f": "avx512", None: "scalar"}.get(widest, widest)  # type: ignore[arg-type]
    elif arch == "arm64":
        widest = next((f for f in ("sve2", "sve", "neon") if f in features), None)
        assert name == (widest or "scalar")
    else:
        assert name == "scalar"


def test_this_machines_fields_are_read_without_an_engine_or_network() -> None:
    fields = fingerprint.machine()
    assert fields["simd"].startswith(f"{edgeinfer.devices(engines=()).arch}/")
    assert fingerprint.engine_build("no such engine") == "unknown"
    for engine in ("llama.cpp", "onnxruntime"):
        build = fingerprint.engine_build(engine)
        assert 0 < len(build) <= 400 and "\n" not in build
