"""The lossy int4 route: a float source made from a quantized GGUF, and a tiny model through
``edgeinfer convert --quant int4 --head-8bit`` with its agreement in the report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.converters.onnx.builder.tensors import F32, GGUFTensors
from edgeinfer.converters.sources.gguf_float import cached_float_gguf, write_float_gguf
from edgeinfer.errors import EdgeInferError
from edgeinfer.files.gguf_file import read_gguf_header


@pytest.fixture(scope="module")
def tiny_q4_1(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama quantized to Q4_1 by llama.cpp, as the default model is."""
    pytest.importorskip("llama_cpp")
    from edgeinfer.converters.gguf.writer import quantize_gguf

    out = tmp_path_factory.mktemp("tiny-q4_1") / "tiny-q4_1.gguf"
    quantize_gguf(tiny_llama_gguf, out, "q4_1", threads=1)
    return out


def _no_partials(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if ".partial" in p.name]


def test_float_source_holds_the_dequantized_values_and_the_metadata(
    tiny_q4_1: Path, tmp_path: Path
) -> None:
    out = write_float_gguf(tiny_q4_1, tmp_path / "f32.gguf")
    src, got = read_gguf_header(tiny_q4_1), read_gguf_header(out)
    assert {t.ggml_type for t in got.tensors} == {F32}
    assert src.metadata.get("general.file_type") == 3  # llama.cpp's MOSTLY_Q4_1
    assert got.metadata["general.file_type"] == 0  # ALL_F32
    assert {k: v for k, v in got.metadata.items() if k != "general.file_type"} == {
        k: v for k, v in src.metadata.items() if k != "general.file_type"
    }
    quantized = GGUFTensors(src, lambda: None)
    floats = GGUFTensors(got, lambda: None)
    assert [(t.name, t.shape) for t in src.tensors] == [(t.name, t.shape) for t in got.tensors]
    assert any(t.ggml_type != F32 for t in src.tensors)
    for a, b in zip(src.tensors, got.tensors, strict=True):
        np.testing.assert_array_equal(floats.floats(b), quantized.floats(a))
    # llama.cpp runs it, and its answer is the quantized file's (the same values)
    with (
        edgeinfer.load(out, context_length=64, threads=1) as f32,
        edgeinfer.load(tiny_q4_1, context_length=64, threads=1) as q4,
    ):
        ids = f32.tokenize("Hello world")
        a = np.array(f32._backend.prefill(ids), np.float64)
        b = np.array(q4._backend.prefill(ids), np.float64)
    assert np.corrcoef(a, b)[0, 1] > 0.99


def test_float_source_is_cached_by_source_and_code(tiny_q4_1: Path, tmp_path: Path) -> None:
    first = cached_float_gguf(tiny_q4_1, home=tmp_path)
    stamp = first.stat().st_mtime_ns
    again = cached_float_gguf(tiny_q4_1, home=tmp_path)
    assert again == first and again.stat().st_mtime_ns == stamp
    assert first.parent.parent == tmp_path / "derived"
    assert "-float-" in first.parent.name


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_damaged_gguf_gives_an_edgeinfer_error_or_a_sound_file(
    tiny_q4_1: Path, tmp_path: Path, data: st.DataObject
) -> None:
    raw = bytearray(tiny_q4_1.read_bytes())
    header_end = read_gguf_header(tiny_q4_1).data_offset
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")]
    else:
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            at = data.draw(st.integers(0, header_end - 1), label="at")
            raw[at] = data.draw(st.integers(0, 255), label="byte")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    out = tmp_path / "out.gguf"
    out.unlink(missing_ok=True)
    try:
        write_float_gguf(bad, out, overwrite=True)
    except EdgeInferError as exc:
        assert str(exc)
        assert not out.exists()
    else:
        assert {t.ggml_type for t in read_gguf_header(out).tensors} == {F32}
    assert _no_partials(tmp_path)


def _convert(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer", "convert", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_cli_int4_route_of_a_float_source_reports_its_agreement(
    tiny_q4_1: Path, tmp_path: Path
) -> None:
    """A tiny model's float source (made from its Q4_1 file) through the real CLI: 4-bit
    projections, 8-bit embedding, the agreement measured and printed."""
    source = write_float_gguf(tiny_q4_1, tmp_path / "f32.gguf")
    out = tmp_path / "int4"
    thresholds = ["--min-top1", "0", "--min-greedy", "0"]
    done = _convert(str(source), "-o", str(out), "--quant", "int4", "--head-8bit", *thresholds)
    assert done.returncode == 0, done.stderr
    assert "top-1 agreement" in done.stderr + done.stdout
    manifest = json.loads((out / "edgeinfer.json").read_text())
    assert set(manifest["quantization"]["nbits"]) == {"4-bit/32", "8-bit/32"}
    report = manifest["validation"]
    assert 0.0 <= report["top1_agreement"] <= 1.0
    assert report["reference"].endswith("through llama.cpp")
    with edgeinfer.load(out, context_length=64, threads=1) as model:
        result = model.generate("Hello", max_new_tokens=4, temperature=0)
    assert result.token_ids


def test_cli_refuses_a_cut_float_source_with_one_line(tiny_q4_1: Path, tmp_path: Path) -> None:
    source = write_float_gguf(tiny_q4_1, tmp_path / "f32.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    done = _convert(str(cut), "-o", str(tmp_path / "out"), "--quant", "int4", "--head-8bit")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
