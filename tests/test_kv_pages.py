"""The ONNX route's KV cache takes memory only where it is written.

numpy advises transparent huge pages for large arrays, and a cache tensor's row per head is
2 MiB at 8,192 positions (float32, head size 64): with huge pages the first token written
made the whole cache resident at once (525 MB at one 8,192-token stream of the default model
where 290 MB is used). The cache is an anonymous mapping kept out of huge pages instead, and
these tests ask the kernel which of its pages are resident (``mincore``).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgeinfer.config import LoadConfig
from edgeinfer.files.manifest import Manifest
from edgeinfer.machine.policy import Candidate

pytest.importorskip("onnxruntime")

from edgeinfer.runtimes import onnx_slots
from edgeinfer.runtimes.onnx_slots import SlotCache, untouched_zeros
from edgeinfer.runtimes.onnxruntime import open_backend

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="asks Linux mincore and forks"
)
PAGE_LIMIT = 64 * 1024  # the largest base page (arm64 with 64 KiB pages)
_CTX = 256  # the tiny model's trained context


def resident_bytes(array: np.ndarray) -> int:
    """Resident bytes of the pages ``array``'s memory spans, as the kernel reports them
    (``mincore``: page by page, whatever mapping the pages lie in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = array.ctypes.data - array.ctypes.data % page
    length = array.ctypes.data + array.nbytes - start
    pages = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(p & 1 for p in pages) * page


def test_untouched_zeros_are_zero_writable_and_page_aligned():
    array = untouched_zeros((2, 3, 5, 7), np.float16)
    assert array.shape == (2, 3, 5, 7) and array.dtype == np.float16
    assert not array.any() and array.flags.writeable
    assert array.ctypes.data % 4096 == 0
    array[1, 2, 4, 6] = 3.0
    assert array.sum() == 3.0


def test_a_forked_child_writes_its_own_copy():
    array = untouched_zeros((4, 1024), np.float32)
    pid = os.fork()
    if pid == 0:  # the child: write, then leave at once
        array[:] = 1.0
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert not array.any()


def test_one_written_entry_makes_one_page_resident_not_the_array():
    array = untouched_zeros((1, 3, 8192, 64), np.float32)  # one cache tensor at 8,192
    assert resident_bytes(array) == 0
    array[0, :, 0, :] = 1.0  # a first token, every head
    assert 0 < resident_bytes(array) <= 3 * PAGE_LIMIT < array.nbytes // 8


@pytest.fixture(scope="module")
def folder(tiny_llama_gguf: Path, native_folder: Callable[[Path, int], Path]) -> Path:
    return native_folder(tiny_llama_gguf, _CTX)


def test_a_backend_at_a_long_context_holds_what_it_wrote(
    folder: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(onnx_slots, "WHOLE_CACHE_LIMIT", 0)  # the tiny model's cache is small
    config = LoadConfig(context_length=_CTX, threads=1, parallel=2)
    candidate = Candidate("CPUExecutionProvider", "cpu", "test")
    backend = open_backend(folder, config, Manifest.read(folder), candidate)
    try:
        arrays = backend._cache.arrays
        cache = sum(a.nbytes for a in arrays)
        page, heads = os.sysconf("SC_PAGE_SIZE"), arrays[0].shape[1]
        if arrays[0][0, 0].nbytes < 4 * page:
            pytest.skip("a head's row spans fewer than 4 pages here")
        backend.prefill(list(range(5, 37)), 1)
        backend.decode(7, 1)
        written = sum(resident_bytes(a) for a in arrays)
        # 33 entries of slot 1: the first page or two of each of its heads' rows, not the rows
        assert 0 < written <= 2 * page * heads * len(arrays) <= cache // 4
    finally:
        backend.close()


def test_a_cache_above_the_limit_is_untouched_and_one_below_is_numpys(
    monkeypatch: pytest.MonkeyPatch,
):
    names = [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    monkeypatch.setattr(onnx_slots, "WHOLE_CACHE_LIMIT", 4 * 2 * 3 * 1024 * 64 * 4 - 1)
    big = SlotCache(names, 2, (3, 1024, 64), np.float32)
    assert all(resident_bytes(a) == 0 and a.ctypes.data % 4096 == 0 for a in big.arrays)
    monkeypatch.setattr(onnx_slots, "WHOLE_CACHE_LIMIT", 4 * 2 * 3 * 1024 * 64 * 4)
    small = SlotCache(names, 2, (3, 1024, 64), np.float32)
    assert all(a.base is None for a in small.arrays)  # numpy's own allocation
