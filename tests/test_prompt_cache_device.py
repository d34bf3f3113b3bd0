"""apps/device_service.py --prompt-cache DIR for real: a long prompt's KV outlives the service,
and a bad DIR is one 'failed' log line and exit 1."""

from __future__ import annotations

import json
from pathlib import Path

from .test_device_service import _start

PROMPT = " ".join(f"Rule {i}: be brief and kind." for i in range(14)) + " Question: hi?"


def _ask(model: Path, cache: Path) -> tuple[dict, str]:
    proc = _start(model, "--context-length", "512", "--prompt-cache", str(cache))
    line = json.dumps({"id": 1, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    out, err = proc.communicate(line + "\n", timeout=600)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[0]), err


def test_a_restarted_service_reads_the_prefix(tiny_gemma_onnx: Path, tmp_path: Path) -> None:
    first, _ = _ask(tiny_gemma_onnx, tmp_path)
    (snapshot,) = tmp_path.glob("*.kvs")
    written = snapshot.stat().st_mtime_ns
    again, _ = _ask(tiny_gemma_onnx, tmp_path)
    assert again["text"] == first["text"]
    assert snapshot.stat().st_mtime_ns > written  # read back (touched as recently used)


def test_a_bad_cache_dir_is_one_failed_line(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    proc = _start(tiny_llama_gguf, "--prompt-cache", str(tmp_path / "file"))
    out, err = proc.communicate("", timeout=300)
    assert proc.returncode == 1 and out == ""
    events = [json.loads(line) for line in err.splitlines()]
    assert events[-1]["event"] == "failed" and "prompt_cache" in events[-1]["error"]
