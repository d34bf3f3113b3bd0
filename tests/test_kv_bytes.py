"""One rule for the KV cache's bytes: the memory plan's and the backend's agree for every
cache type, and a float32 llama.cpp cache's snapshot restores (its size check uses them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edgeinfer

from . import ggufgen


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ggufgen.tiny_llama(seed=2).write(tmp_path_factory.mktemp("kvb") / "t.gguf")


@pytest.mark.parametrize("kv_dtype", ["auto", "float16", "float32"])
def test_the_backend_and_the_plan_count_the_same_kv_bytes(tiny: Path, kv_dtype: str) -> None:
    with edgeinfer.load(tiny, threads=1, context_length=128, kv_dtype=kv_dtype) as model:
        info = model.info
        plan = info["memory_plan"]
        assert info["kv_cache_bytes"] == plan["kv_bytes_per_token"] * 128
    element = 4 if kv_dtype == "float32" else 2
    # 2 layers x 2 KV heads x (16 + 16) per head x element bytes, per token
    assert plan["kv_bytes_per_token"] == 2 * 2 * 32 * element


def test_a_float32_cache_snapshot_restores_exactly(tiny: Path, tmp_path: Path) -> None:
    prompt = "the cat sat on the mat and looked at the door " * 3
    with edgeinfer.load(tiny, threads=1, context_length=128, kv_dtype="float32") as model:
        model.generate(prompt, max_new_tokens=1, temperature=0)
        model.save_state(tmp_path / "s.kvs")
        want = model.generate(prompt + "again", max_new_tokens=8, temperature=0)
    with edgeinfer.load(tiny, threads=1, context_length=128, kv_dtype="float32") as model:
        model.load_state(tmp_path / "s.kvs")
        got = model.generate(prompt + "again", max_new_tokens=8, temperature=0)
        assert got.stats.reused_prompt_tokens > 0
    assert np.array_equal(got.token_ids, want.token_ids)
