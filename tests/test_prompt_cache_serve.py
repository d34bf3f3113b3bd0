"""`edgeinfer serve --prompt-cache DIR` for real: a long prompt's KV outlives the server, and a
restarted server reads it back (the snapshot is touched) and answers as before."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_serve import KEY, Server, _start

openai = pytest.importorskip("openai")

SYSTEM = "You are a support assistant. " + " ".join(
    f"Rule {i}: answer in one short sentence and stay polite." for i in range(40)
)


def _ask(server: Server, question: str) -> str:
    # a long prompt on the real model: minutes on a busy 2-core machine
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=900)
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=6,
        temperature=0,
    )
    return reply.choices[0].message.content


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "cache"


@pytest.mark.model
def test_a_restarted_server_reads_the_cached_prefix(default_gguf: Path, cache_dir: Path) -> None:
    extra = ("--api-key", KEY, "--prompt-cache", str(cache_dir), "--context-length", "1024")
    gen = _start(default_gguf, *extra)
    server = next(gen)
    try:
        first = _ask(server, "Where is my parcel?")
    finally:
        gen.close()
    (snapshot,) = cache_dir.glob("*.kvs")
    written = snapshot.stat().st_mtime_ns
    gen = _start(default_gguf, *extra)
    server = next(gen)
    try:
        again = _ask(server, "Where is my parcel?")
    finally:
        gen.close()
    assert again == first
    assert snapshot.stat().st_mtime_ns > written  # read back (touched as recently used)


def test_a_prompt_cache_path_that_is_a_file_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    out = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "serve", "nonexistent.gguf",
         "--prompt-cache", str(tmp_path / "file")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "prompt_cache" in lines[0] and "Traceback" not in out.stderr
