"""The automatic prompt cache: long prompts' KV written in the background, found again by
prefix in this process or another, exact; hostile files in the folder ignored."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.errors import InvalidRequestError
from edgeinfer.generation.state import PromptCache

pytest.importorskip("transformers", reason="needs the convert extra")

_ENGINES = {"gguf": "tiny_llama_gguf", "native-onnx": "tiny_native_onnx"}


@pytest.fixture(scope="module")
def tiny_native_onnx(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("onnxruntime")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    folder = tmp_path_factory.mktemp("tiny-native-pc") / "native"
    folder.mkdir()
    write_gguf_folder(tiny_llama_gguf, folder, max_context=256)
    return folder


@pytest.fixture(scope="module", params=sorted(_ENGINES))
def tiny_path(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(_ENGINES[request.param])


def _load(path: Path, cache: object = None, parallel: int = 1) -> edgeinfer.Model:
    return edgeinfer.load(
        path, context_length=256, threads=1, prompt_cache=cache, parallel=parallel
    )


def _prompts(model: edgeinfer.Model) -> tuple[list[int], list[int]]:
    text = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(12))
    first = model.tokenize(text + " Question one: who are you?")[:120]
    second = first[:100] + model.tokenize(" Another question: where?", add_special=False)
    return first, second


def _fill(path: Path, folder: Path, parallel: int = 1) -> tuple[list[int], tuple[int, ...]]:
    """One snapshot written into ``folder``; the second prompt and a fresh model's answer."""
    with _load(path, PromptCache(folder, min_tokens=32), parallel) as model:
        first, second = _prompts(model)
        result = model.generate(first, max_new_tokens=3, temperature=0)
        assert result.stats.disk_prompt_tokens == 0
    assert len(list(folder.glob("*.kvs"))) == 1  # close() waited for the write
    with _load(path) as fresh:
        want = fresh.generate(second, max_new_tokens=6, temperature=0).token_ids
    return second, want


def test_a_later_model_reads_the_prefix_from_disk(tiny_path: Path, tmp_path: Path) -> None:
    second, want = _fill(tiny_path, tmp_path)
    with _load(tiny_path, PromptCache(tmp_path, min_tokens=32)) as model:
        result = model.generate(second, max_new_tokens=6, temperature=0)
        stats = model.info["prompt_cache"]
    assert result.stats.disk_prompt_tokens == 96 == result.stats.reused_prompt_tokens
    assert result.token_ids == want
    assert stats["hits"] == 1 and stats["disk_tokens"] == 96 and stats["ignored_files"] == 0


def test_a_new_process_reads_the_prefix(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    second, want = _fill(tiny_llama_gguf, tmp_path)
    script = textwrap.dedent(
        f"""
        import edgeinfer, json
        from edgeinfer.generation.state import PromptCache
        m = edgeinfer.load({str(tiny_llama_gguf)!r}, context_length=256, threads=1,
                           prompt_cache=PromptCache({str(tmp_path)!r}, min_tokens=32))
        r = m.generate({second!r}, max_new_tokens=6, temperature=0)
        print(json.dumps([r.stats.disk_prompt_tokens, list(r.token_ids)]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    disk, ids = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert disk == 96 and tuple(ids) == want


def _hostile_folder(path: Path, folder: Path, tiny_qwen2_gguf: Path, outside: Path) -> int:
    """Next to the good snapshot: another model's, a truncated copy, a flipped byte, text, an
    empty file, a symlink out of the folder; the number of bad files."""
    (good,) = folder.glob("*.kvs")
    raw = good.read_bytes()
    (folder / "truncated.kvs").write_bytes(raw[: len(raw) // 2])
    (folder / "flipped.kvs").write_bytes(raw[:-5] + bytes([raw[-5] ^ 0x40]) + raw[-4:])
    (folder / "text.kvs").write_text("not a snapshot")
    (folder / "empty.kvs").write_bytes(b"")
    outside.mkdir()
    (outside / "x.kvs").write_bytes(raw)
    (folder / "link.kvs").symlink_to(outside / "x.kvs")
    with _load(tiny_qwen2_gguf, PromptCache(outside, min_tokens=32)) as other:
        other.generate(_prompts(other)[0], max_new_tokens=1)
    (foreign,) = [p for p in outside.glob("*.kvs") if p.name != "x.kvs"]
    os.replace(foreign, folder / "foreign.kvs")
    good.unlink()  # only hostile files left
    return 6


def test_hostile_files_are_ignored_with_one_warning_each(
    tiny_path: Path, tiny_qwen2_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "cache"
    second, want = _fill(tiny_path, folder)
    bad = _hostile_folder(tiny_path, folder, tiny_qwen2_gguf, tmp_path / "outside")
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="edgeinfer.generation.state")
    with _load(tiny_path, PromptCache(folder, min_tokens=32, max_bytes=1 << 30)) as model:
        for _ in range(2):
            result = model.generate(second, max_new_tokens=6, temperature=0)
            assert result.token_ids == want and result.stats.disk_prompt_tokens == 0
        stats = model.info["prompt_cache"]
    assert stats["ignored_files"] + stats["restore_failures"] == bad
    warnings = [r for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(warnings) == bad  # one each, not one per request


def test_a_flipped_payload_byte_is_caught_at_restore(tiny_path: Path, tmp_path: Path) -> None:
    """The header is intact, so the file is chosen; its checksum fails while reading: the
    slot is emptied and the prompt read whole."""
    second, want = _fill(tiny_path, tmp_path)
    (good,) = tmp_path.glob("*.kvs")
    raw = bytearray(good.read_bytes())
    raw[-3] ^= 0x01
    good.write_bytes(bytes(raw))
    with _load(tiny_path, PromptCache(tmp_path, min_tokens=32)) as model:
        result = model.generate(second, max_new_tokens=6, temperature=0)
        assert model.info["prompt_cache"]["restore_failures"] == 1
    assert result.token_ids == want and result.stats.disk_prompt_tokens == 0


def test_a_full_disk_loses_only_the_snapshot(
    tiny_llama_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.write

    def full(fd: int, data: object) -> int:
        if fd > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "write", full)
    with _load(tiny_llama_gguf, PromptCache(tmp_path, min_tokens=32)) as model:
        first, _ = _prompts(model)
        assert model.generate(first, max_new_tokens=3).finish_reason in ("stop", "length")
        model._disk.flush()
        assert model.info["prompt_cache"]["write_failures"] == 1
    assert list(tmp_path.iterdir()) == []


def test_the_folder_stays_under_its_cap(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    with _load(tiny_llama_gguf, PromptCache(tmp_path, min_tokens=32)) as model:
        first, _ = _prompts(model)
        model.generate(first, max_new_tokens=1)
    one = sum(p.stat().st_size for p in tmp_path.glob("*.kvs"))
    cache = PromptCache(tmp_path, min_tokens=32, max_bytes=int(one * 1.5))
    with _load(tiny_llama_gguf, cache) as model:
        for word in ("apples", "pears", "plums"):
            prompt = model.tokenize(f"{word} " * 60)[:120]
            model.generate(prompt, max_new_tokens=1)
            model._disk.flush()
    sizes = [p.stat().st_size for p in tmp_path.glob("*.kvs")]
    assert sum(sizes) <= one * 1.5 and len(sizes) == 1 and cache.stats["evicted"] >= 3


def test_bad_prompt_cache_values_are_refused(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for value in (5, tmp_path / "file", ""):
        with pytest.raises(InvalidRequestError, match="prompt_cache"):
            _load(tiny_llama_gguf, value)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        PromptCache(tmp_path, min_tokens=0)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(files=st.lists(st.binary(max_size=300), min_size=1, max_size=4), data=st.data())
def test_hostile_bytes_in_the_folder(
    tiny_llama_gguf: Path,
    tmp_path_factory: pytest.TempPathFactory,
    files: list[bytes],
    data: st.DataObject,
) -> None:
    """Any bytes named *.kvs, with or without a valid magic: the cache finds nothing and the
    request runs as without it."""
    folder = tmp_path_factory.mktemp("hostile")
    from edgeinfer.generation.state.snapshot import MAGIC

    for i, blob in enumerate(files):
        prefix = MAGIC + b"\x01\x00\x00\x00" if data.draw(st.booleans()) else b""
        (folder / f"{i}.kvs").write_bytes(prefix + blob)
    model = _hostile_model(tiny_llama_gguf)
    cache = PromptCache(folder, min_tokens=32)
    from edgeinfer.generation.state.sequence import SeqStates

    states = SeqStates(model._backend, model._path)
    prompt = _prompts(model)[1]
    assert cache.restore(states, model._backend, model._history, prompt) == 0
    assert cache.stats["ignored_files"] == len(files)


_MODELS: dict[Path, edgeinfer.Model] = {}


def _hostile_model(path: Path) -> edgeinfer.Model:
    if path not in _MODELS:
        _MODELS[path] = _load(path)
    return _MODELS[path]


def test_crash_a_real_process_on_a_hostile_folder(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """A real process over a folder of hostile files answers (exit 0) and says why it skipped
    them on stderr, one line each."""
    for name, blob in {
        "a.kvs": b"EIKVSNAP\x01\x00\x00\x00\xff\xff\xff\xff",
        "b.kvs": b"EIKVSNAP\x01\x00\x00\x00\x05\x00\x00\x00{}{}{" + b"\0" * 40,
        "c.kvs": os.urandom(4096),
    }.items():
        (tmp_path / name).write_bytes(blob)
    (tmp_path / "d.kvs").symlink_to("/dev/zero")
    script = textwrap.dedent(
        f"""
        import edgeinfer, signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from edgeinfer.generation.state import PromptCache
        m = edgeinfer.load({str(tiny_llama_gguf)!r}, context_length=256, threads=1,
                           prompt_cache=PromptCache({str(tmp_path)!r}, min_tokens=32))
        r = m.generate("word " * 30, max_new_tokens=3)
        print("ANSWERED", r.finish_reason, m.info["prompt_cache"]["ignored_files"])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ANSWERED" in out.stdout and out.stdout.split()[-1] == "4"


def test_the_engine_restores_a_prefix_into_a_slot(tiny_path: Path, tmp_path: Path) -> None:
    """At parallel=2 the engine reads the prefix from disk into the slot it gives a request,
    and writes snapshots of long prompts too (llama.cpp: a state of a context of 2 sequences
    is another layout than one of 1)."""
    second, want = _fill(tiny_path, tmp_path, parallel=2)
    cache = PromptCache(tmp_path, min_tokens=32)
    with edgeinfer.load(
        tiny_path, context_length=256, threads=1, parallel=2, prompt_cache=cache
    ) as model:
        results = model.generate_many([second, second[:30]], max_new_tokens=6, temperature=0)
    assert results[0].stats.disk_prompt_tokens == 96
    assert results[0].token_ids == want
    assert results[1].stats.disk_prompt_tokens == 0  # 28 reusable tokens: under min_tokens
