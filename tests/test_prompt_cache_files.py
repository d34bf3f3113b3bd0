"""What the prompt cache deletes: only the snapshots it wrote (a valid header whose fingerprint
and tokens hash to the file's name) and its own stale temporary files, the least recently used
first; never a user's file in the folder (``notes.kvs``, a ``save_state`` file, a symlink)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.generation.state import PromptCache
from edgeinfer.generation.state.prompt_cache import _name
from edgeinfer.generation.state.snapshot import (
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    write_snapshot,
)

FP = {"model_sha256": "0" * 64, "backend": "test", "layout": {"n_ctx": 64}}
HOUR = 3600.0


def _own(folder: Path, tokens: tuple[int, ...], mtime: float, size: int = 200) -> Path:
    """A snapshot as the cache writes it, last used at ``mtime``."""
    path = folder / _name(FP, list(tokens))
    write_snapshot(path, FP, tokens, len(tokens), [b"k" * size])
    os.utime(path, (mtime, mtime))
    return path


def _cache(folder: Path, max_bytes: int) -> PromptCache:
    return PromptCache(folder, max_bytes=max_bytes, min_tokens=32)


def test_the_least_recently_used_goes_first(tmp_path: Path) -> None:
    now = time.time()
    a, b, c = (_own(tmp_path, (i, i + 1), now - 300 + 100 * i) for i in range(3))
    one = a.stat().st_size
    cache = _cache(tmp_path, max_bytes=2 * one + one // 2)
    cache.evict()
    assert not a.exists() and b.exists() and c.exists()  # the oldest went, not the newest
    os.utime(b, (now + 10, now + 10))  # b used again: c is now the least recently used
    _cache(tmp_path, max_bytes=one + one // 2).evict()
    assert b.exists() and not c.exists()
    assert cache.stats["evicted"] == 1 and cache.stats["foreign_files"] == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ages=st.lists(st.integers(0, 10**6), min_size=1, max_size=8, unique=True),
    sizes=st.lists(st.integers(1, 3000), min_size=8, max_size=8),
    cap=st.integers(1, 30_000),
)
def test_eviction_keeps_exactly_the_most_recently_used_that_fit(
    tmp_path_factory: pytest.TempPathFactory, ages: list[int], sizes: list[int], cap: int
) -> None:
    """Oldest first until the rest fit: which files are left is the reference's, exactly."""
    folder = tmp_path_factory.mktemp("lru")
    now = time.time()
    files = [_own(folder, (i,), now - age, sizes[i]) for i, age in enumerate(ages)]
    total = sum(p.stat().st_size for p in files)
    want = set(files)
    for path in sorted(files, key=lambda p: p.stat().st_mtime_ns):
        if total <= cap:
            break
        want.discard(path)
        total -= path.stat().st_size
    _cache(folder, max_bytes=cap).evict()
    assert {p for p in files if p.exists()} == want


def _valid_raw() -> bytes:
    """The bytes of a valid snapshot (to be found under a name the cache did not give it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "x.kvs"
        write_snapshot(path, FP, (7, 8, 9), 3, [b"v" * 300])
        return path.read_bytes()


VALID = _valid_raw()


def _foreign_folder(folder: Path, outside: Path) -> dict[str, bytes | None]:
    """Files the cache did not write (name -> bytes; None: not a regular file)."""
    old = time.time() - 2 * HOUR
    files: dict[str, bytes | None] = {
        "notes.kvs": b"my notes, not a snapshot\n",
        "mine.kvs": VALID,  # a save_state file: valid, but not named by the cache
        "0" * 40 + ".kvs": VALID,  # a hash-shaped name that is not this content's hash
        ".notes.tmp": b"a user's temporary file",
        ".x.kvs.1.tmp": b"not the cache's temporary name",
        "empty.kvs": b"",
        "huge-claim.kvs": MAGIC + FORMAT_VERSION.to_bytes(4, "little") + b"\xff\xff\xff\x7f",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)  # type: ignore[arg-type]
        os.utime(folder / name, (old, old))
    outside.mkdir(exist_ok=True)
    target = _own(outside, (1, 2, 3), old)
    (folder / target.name).symlink_to(target)  # the cache's name, but a link: not its file
    (folder / "dir.kvs").mkdir()
    files[target.name] = files["dir.kvs"] = None
    return files


def test_a_users_files_survive_eviction_and_are_named_in_the_stats(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    foreign = _foreign_folder(folder, tmp_path / "outside")
    old = time.time() - 2 * HOUR
    own = [_own(folder, (i, 9), old + i) for i in range(3)]
    stale = folder / f".{own[0].name}.4242.tmp"  # left by a writer that was killed
    stale.write_bytes(b"half a snapshot")
    os.utime(stale, (old, old))
    cache = _cache(folder, max_bytes=1)
    cache.evict()
    assert not any(p.exists() for p in own) and not stale.exists()
    for name, data in foreign.items():
        path = folder / name
        assert path.is_symlink() or path.exists(), name
        if data is not None:
            assert path.read_bytes() == data, name
    stats = cache.stats
    assert stats["evicted"] == 3 and stats["foreign_files"] == len(foreign)
    assert stats["foreign_names"] == sorted(foreign)[:16]


def test_a_header_claiming_the_largest_size_is_read_once_and_kept(tmp_path: Path) -> None:
    """A sparse file whose header says MAX_HEADER_BYTES of JSON: bounded, not a snapshot."""
    path = tmp_path / ("a" * 40 + ".kvs")
    with open(path, "wb") as fh:
        fh.write(MAGIC + FORMAT_VERSION.to_bytes(4, "little"))
        fh.write(MAX_HEADER_BYTES.to_bytes(4, "little"))
        fh.truncate(MAX_HEADER_BYTES + 64)
    cache = _cache(tmp_path, max_bytes=1)
    cache.evict()
    assert path.exists() and cache.stats["foreign_files"] == 1


_NAMES = st.one_of(
    st.from_regex(r"[0-9a-f]{40}\.kvs", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_.-]{1,20}\.kvs", fullmatch=True),
    st.from_regex(r"\.[0-9a-z]{1,40}\.kvs\.[0-9]{1,6}\.tmp", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,20}", fullmatch=True),
)
_BYTES = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda tail: MAGIC + tail, st.binary(max_size=300)),
    st.builds(lambda n: MAGIC + FORMAT_VERSION.to_bytes(4, "little") + n.to_bytes(4, "little"),
              st.integers(0, 2**32 - 1)),
    st.just(VALID),
    st.builds(lambda cut: VALID[:cut], st.integers(0, len(VALID) - 1)),
)  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    files=st.dictionaries(_NAMES, _BYTES, max_size=6),
    links=st.lists(_NAMES, max_size=2, unique=True),
    old=st.booleans(),
)
def test_hostile_folders_lose_only_the_caches_own_files(
    tmp_path_factory: pytest.TempPathFactory,
    files: dict[str, bytes],
    links: list[str],
    old: bool,
) -> None:
    """Any names (snapshot-shaped or not), any bytes (valid snapshots under other names,
    truncated ones, lying header sizes), symlinks, old or new: after an eviction that wants
    the folder empty, every file the cache did not write is there with its bytes."""
    folder = tmp_path_factory.mktemp("hostile-evict")
    when = time.time() - (2 * HOUR if old else 0)
    for name, data in files.items():
        (folder / name).write_bytes(data)
        os.utime(folder / name, (when, when))
    for name in links:
        if name not in files:
            (folder / name).symlink_to(folder / "elsewhere")
    own = _own(folder, (5, 6, 7), when)
    if own.name in files:
        return  # hypothesis drew the own file's name; nothing to tell apart
    cache = _cache(folder, max_bytes=1)
    cache.evict()
    assert not own.exists()
    for name, data in files.items():
        assert (folder / name).read_bytes() == data, name
    assert all((folder / n).is_symlink() for n in links if n not in files)


def _prompts(model: edgeinfer.Model) -> list[list[int]]:
    return [model.tokenize(f"{word} " * 60)[:120] for word in ("apples", "pears", "plums")]


def test_a_restore_makes_a_snapshot_the_most_recently_used(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    """Through a model: A and B written (A older), A read back, then C written into a folder
    that holds two: B goes, A and C stay."""
    kvs = lambda: set(tmp_path.glob("*.kvs"))  # noqa: E731
    with edgeinfer.load(tiny_llama_gguf, context_length=256, threads=1) as probe:
        a, b, c = _prompts(probe)
    cache = PromptCache(tmp_path, min_tokens=32)
    with edgeinfer.load(tiny_llama_gguf, context_length=256, threads=1, prompt_cache=cache) as m:
        m.generate(a, max_new_tokens=1)
        m._disk.flush()
        (file_a,) = kvs()
        m.generate(b, max_new_tokens=1)
        m._disk.flush()
        (file_b,) = kvs() - {file_a}
        now = time.time()
        os.utime(file_a, (now - 200, now - 200))
        os.utime(file_b, (now - 100, now - 100))
        cache.max_bytes = int(1.05 * (file_a.stat().st_size + file_b.stat().st_size))  # two
        assert m.generate(a, max_new_tokens=1).stats.disk_prompt_tokens > 0  # touches A
        m.generate(c, max_new_tokens=1)
        m._disk.flush()
    (file_c,) = kvs() - {file_a, file_b}
    assert file_a.exists() and file_c.exists() and not file_b.exists()


def test_a_save_state_file_in_the_folder_is_never_dropped_as_covered(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    """A user's snapshot (save_state) in the cache's folder, which a longer prompt's new
    snapshot covers: the cache may read it, but keeps it."""
    mine = tmp_path / "mine.kvs"
    with edgeinfer.load(tiny_llama_gguf, context_length=256, threads=1) as model:
        a = _prompts(model)[0][:80]
        model.generate(a, max_new_tokens=1, temperature=0)
        model.save_state(mine)
        tokens = model.load_state(mine)
        longer = tokens + model.tokenize(" and pears " * 20, add_special=False)[:80]
    data = mine.read_bytes()
    cache = PromptCache(tmp_path, min_tokens=32)
    with edgeinfer.load(tiny_llama_gguf, context_length=256, threads=1, prompt_cache=cache) as m:
        m.generate(longer, max_new_tokens=1)
        m._disk.flush()
    assert cache.stats["writes"] == 1 and len(list(tmp_path.glob("*.kvs"))) == 2
    assert mine.read_bytes() == data


def test_a_real_process_evicting_beside_a_users_files(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    """A child process whose cache must evict everything it writes (max_bytes=1) in a folder
    holding a user's files: it answers, exits 0, and every user file is there, unchanged."""
    import subprocess
    import sys
    import textwrap

    folder = tmp_path / "cache"
    folder.mkdir()
    foreign = _foreign_folder(folder, tmp_path / "outside")
    script = textwrap.dedent(
        f"""
        import signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import edgeinfer
        from edgeinfer.generation.state import PromptCache
        cache = PromptCache({str(folder)!r}, min_tokens=32, max_bytes=1)
        with edgeinfer.load({str(tiny_llama_gguf)!r}, context_length=256, threads=1,
                            prompt_cache=cache) as m:
            r = m.generate(m.tokenize("pears " * 60)[:120], max_new_tokens=2)
        s = cache.stats
        print("ANSWERED", r.finish_reason, s["writes"], s["evicted"], s["foreign_files"])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    words = done.stdout.split()
    assert words[0] == "ANSWERED" and words[2:] == ["1", "1", str(len(foreign))]
    for name, data in foreign.items():
        path = folder / name
        assert path.is_symlink() or path.exists(), name
        assert data is None or path.read_bytes() == data, name
    assert {p.name for p in folder.glob("[0-9a-f]" * 40 + ".kvs")} <= set(foreign)  # its own: gone
