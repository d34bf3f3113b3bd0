"""A lone sequence's step on the ONNX route, and why it may carry a second row.

onnxruntime's 4-bit ``MatMulNBits`` picks its kernel by CPU, and on some CPUs (AVX2) a one-row
product is computed by another kernel than a product of two or more rows, whose rows agree bit
for bit whatever their number. The backend probes this once at load (``info["lone_steps"]``):
where a lone row differs, every step of a lone sequence carries a second row (the next slot's
row, its entry 0 saved and put back, or a spare row past the last slot), so a reply is the
same whether the sequence ran alone or beside others.

Where this machine's kernels agree, the backend runs lone steps alone; the pairing is then
checked here by switching it on (``_rows``), on the tiny graph whose rows agree either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgeinfer.config import LoadConfig
from edgeinfer.files.manifest import Manifest
from edgeinfer.machine.policy import Candidate

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from edgeinfer.runtimes.onnx_slots import plan_step
from edgeinfer.runtimes.onnxruntime import OrtBackend, open_backend

_CPU = Candidate("CPUExecutionProvider", "cpu", "test")
_CTX = 64


@given(
    pasts=st.lists(st.integers(0, _CTX - 1), min_size=1, max_size=8),
    pick=st.integers(0, 7),
    token=st.integers(0, 99),
)
def test_a_lone_step_spans_two_rows_with_a_spare_row(
    pasts: list[int], pick: int, token: int
) -> None:
    slot = pick % len(pasts)
    rows = len(pasts) + 1  # the slots and one spare row
    step = plan_step([(slot, token)], pasts, _CTX, 100, rows)
    assert step.ids.shape == (2, 1) and 0 <= step.row and step.row + 2 <= rows
    at = slot - step.row
    assert at in (0, 1) and step.ids[at, 0] == token and step.positions[at, 0] == pasts[slot]
    assert step.order == [at] and step.lengths == {slot: pasts[slot] + 1}
    other = step.row + 1 - at
    assert step.saved_rows == ([other] if other < len(pasts) and pasts[other] else [])
    assert step.mask[1 - at].sum() == 1  # the padding row reads one entry: its own
    alone = plan_step([(slot, token)], pasts, _CTX, 100)  # no spare row: one row
    assert alone.ids.shape == (1, 1) and alone.order is None


def _backend(folder: Path, parallel: int) -> OrtBackend:
    config = LoadConfig(context_length=_CTX, threads=1, parallel=parallel)
    return open_backend(folder, config, Manifest.read(folder), _CPU)


@pytest.fixture(scope="module")
def folder(tiny_llama_gguf: Path, native_folder: Callable[[Path, int], Path]) -> Path:
    return native_folder(tiny_llama_gguf, _CTX)


def _lone_and_paired(backend: OrtBackend, prompt: list[int], tokens: list[int]) -> list[bool]:
    """Whether each token's logits are bit for bit the same run alone and paired, in slot 0."""
    runs = []
    for paired in (False, True):
        backend.rewind(0, 0)
        backend._pair(paired)
        backend.prefill(prompt, 0)
        runs.append([np.array(backend.decode(t, 0)) for t in tokens])
    backend.rewind(0, 0)
    return [np.array_equal(a, b) for a, b in zip(*runs, strict=True)]


def test_the_load_probe_says_what_the_kernels_do(folder: Path) -> None:
    backend = _backend(folder, 1)
    try:
        kept = backend._rows
        lone = backend.info["lone_steps"]
        same = _lone_and_paired(backend, [5, 9, 11], [7, 3, 250])
        assert lone == ("one row" if all(same) else "paired")
        assert (kept is None) == all(same)
    finally:
        backend.close()


def test_paired_steps_keep_every_other_slot_and_give_the_lone_logits(folder: Path) -> None:
    """Pairing on: slot 0's steps ride beside slot 1's row and slot 1's and 2's beside a
    neighbour's, each holding a sequence (its entry 0 written by the padding token and put
    back); every sequence then continues as a lone one does. At one slot, the spare row."""
    many = _backend(folder, 3)
    one = _backend(folder, 1)
    try:
        one._rows = many._rows = None  # the lone reference: one row per step
        prompts = [[5, 9, 11, 13], [21, 22, 23], [40, 41]]
        tokens = [7, 3, 250, 8]
        want = []
        for prompt in prompts:
            one.rewind(0)
            one.prefill(prompt)
            want.append([np.array(one.decode(t)) for t in tokens])
        many._pair(True)
        for slot, prompt in enumerate(prompts):
            many.prefill(prompt, slot)
        got: list[list[np.ndarray]] = [[], [], []]
        for t in tokens:  # slot 0 and 2 alone (paired), then slot 1 alone
            for slot in (0, 2, 1):
                got[slot].append(np.array(many.decode(t, slot)))
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
                assert int(np.argmax(a)) == int(np.argmax(b))
        assert [many.slot_past(s) for s in range(3)] == [len(p) + 4 for p in prompts]
        one.rewind(0)
        one._pair(True)  # one slot: a spare row, the cache made again while empty
        assert len(one._cache.arrays[0]) == 2 and one.kv_nbytes == 2 * many.kv_nbytes // 3
        one.prefill(prompts[0])
        for t, w in zip(tokens, want[0], strict=True):
            got1 = np.array(one.decode(t))
            np.testing.assert_allclose(got1, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))
    finally:
        many.close()
        one.close()
