from __future__ import annotations

from pathlib import Path

import pytest

from edgeinfer import ModelLoadError
from edgeinfer.files.gguf_file import ArrayInfo, read_gguf_header

from .ggufgen import write_gguf


def test_reads_metadata_and_tensor_table(tmp_path: Path) -> None:
    header = read_gguf_header(write_gguf(tmp_path / "m.gguf", arrays=3000))
    assert header.architecture == "llama"
    assert header.arch_value("context_length") == 2048
    assert header.metadata["tokenizer.chat_template"].startswith("{{")
    assert header.metadata["tokenizer.ggml.tokens"] == ArrayInfo(8, 3000)
    assert [t.name for t in header.tensors] == ["blk.0.weight", "blk.1.weight"]
    assert header.weight_nbytes == 2 * 8 * 4 * 4


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.99])
def test_truncated_file_is_refused(tmp_path: Path, keep: float) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="truncated"):
        read_gguf_header(path)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"hello, I am a text file\n" * 10, "not a GGUF file"),
        (b"GGUF" + (99).to_bytes(4, "little") + b"\0" * 40, "version 99"),
        (b"GGUF", "too small"),
        (b"GGUF\x03\0\0\0" + b"\xff" * 16 + b"\0" * 8, "corrupt"),
    ],
)
def test_not_a_gguf_is_refused(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=match):
        read_gguf_header(path)


def test_random_garbage_never_escapes_as_another_error(tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    good = write_gguf(tmp_path / "m.gguf").read_bytes()
    for i in range(200):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        path = tmp_path / f"fuzz{i}.gguf"
        path.write_bytes(bytes(data))
        try:
            read_gguf_header(path)
        except ModelLoadError:
            pass
