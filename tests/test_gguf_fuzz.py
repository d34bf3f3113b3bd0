"""GGUF headers from strangers: whatever the bytes, read_gguf_header returns a header or
raises ModelLoadError — no other exception, no read past the file, no huge allocation."""

from __future__ import annotations

import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer import ModelLoadError
from edgeinfer.files.gguf_file import GGUFHeader, StringInfo, read_gguf_header

from .ggufgen import write_gguf

FUZZ = settings(
    max_examples=400,
    deadline=2000,  # ms: a header must parse (or fail) fast whatever it claims
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


@pytest.fixture(scope="module")
def valid(scratch: Path) -> bytes:
    return write_gguf(scratch / "valid.gguf", arrays=1500).read_bytes()


def _read(folder: Path, data: bytes) -> GGUFHeader | None:
    """Parse ``data``; None when it was refused with ModelLoadError (anything else fails)."""
    path = folder / "fuzz.gguf"
    path.write_bytes(data)
    try:
        header = read_gguf_header(path)
    except ModelLoadError:
        return None
    assert header.data_offset <= len(data)
    assert all(header.data_offset + t.offset + (t.nbytes or 0) <= len(data) for t in header.tensors)
    return header


# -- building headers by hand: every field may hold what a hostile writer puts there ---------


def _s(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}

keys = st.one_of(
    st.sampled_from(
        [
            b"general.architecture",
            b"general.alignment",
            b"llama.block_count",
            b"llama.context_length",
            b"llama.attention.head_count",
            b"tokenizer.chat_template",
            b"tokenizer.ggml.tokens",
        ]
    ),
    st.binary(max_size=24),  # bad UTF-8 included
)


@st.composite
def values(draw: st.DrawFn, depth: int = 0) -> bytes:
    """A metadata value: its type tag followed by its payload (sometimes nonsense)."""
    vtype = draw(st.integers(0, 14))
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.pack("<I", vtype) + draw(st.binary(min_size=struct.calcsize(fmt)))[:8]
    if vtype == 8:
        return struct.pack("<I", 8) + _s(draw(st.binary(max_size=32)))
    if vtype == 9 and depth < 3:
        items = draw(st.lists(values(depth + 1), max_size=4))
        element = draw(st.integers(0, 14))
        length = draw(st.one_of(st.just(len(items)), st.integers(0, 2**64 - 1)))
        return struct.pack("<IIQ", 9, element, length) + b"".join(i[4:] for i in items)
    return struct.pack("<I", vtype) + draw(st.binary(max_size=16))


@st.composite
def tensor_entries(draw: st.DrawFn) -> bytes:
    big = st.integers(0, 2**64 - 1)
    dims = draw(st.lists(st.one_of(st.integers(0, 64), big), max_size=5))
    n_dims = draw(st.one_of(st.just(len(dims)), st.integers(0, 2**32 - 1)))
    ggml_type = draw(st.one_of(st.sampled_from([0, 1, 2, 8, 12, 39]), st.integers(0, 2**32 - 1)))
    offset = draw(st.one_of(st.sampled_from([0, 32, 64, 100]), big))
    name = draw(st.one_of(st.just(b"blk.0.weight"), st.binary(max_size=12)))
    return (
        _s(name)
        + struct.pack("<I", n_dims)
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


@st.composite
def headers(draw: st.DrawFn) -> bytes:
    kv = draw(st.lists(st.tuples(keys, values()), max_size=6))
    tensors = draw(st.lists(tensor_entries(), max_size=4))
    counts = st.one_of(st.just(None), st.integers(0, 2**64 - 1))
    n_kv, n_tensors = draw(counts), draw(counts)
    out = b"GGUF" + struct.pack("<I", draw(st.sampled_from([2, 3, 1, 4, 2**32 - 1])))
    out += struct.pack("<Q", len(tensors) if n_tensors is None else n_tensors)
    out += struct.pack("<Q", len(kv) if n_kv is None else n_kv)
    out += b"".join(_s(k) + v for k, v in kv) + b"".join(tensors)
    out += b"\0" * (-len(out) % 32) + draw(st.binary(max_size=256))
    return out


@FUZZ
@given(data=headers())
def test_random_headers_parse_or_raise_model_load_error(scratch: Path, data: bytes) -> None:
    _read(scratch, data)


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=8,
    ),
    byte=st.integers(0, 255),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_mutated_valid_headers_parse_or_raise_model_load_error(
    scratch: Path, valid: bytes, edits: list[tuple[str, int]], byte: int, cut: int | None
) -> None:
    data = bytearray(valid)
    header_end = 700  # the metadata and tensor table of the valid file live in front
    for kind, where in edits:
        at = where % min(len(data), header_end) if data else 0
        if kind == "flip" and data:
            data[at] ^= 1 << (where % 8)
        elif kind == "set" and data:
            data[at] = byte
        elif kind == "insert":
            data[at:at] = bytes([byte]) * (1 + where % 9)
        elif data:
            del data[at : at + 1 + where % 9]
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    _read(scratch, bytes(data))


def test_a_valid_file_still_parses(scratch: Path, valid: bytes) -> None:
    header = _read(scratch, valid)
    assert header is not None and header.arch_value("context_length") == 2048


def _kv_file(folder: Path, *entries: bytes, n_tensors: int = 0, tail: bytes = b"") -> Path:
    path = folder / "crafted.gguf"
    body = b"".join(entries)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(entries)) + body + tail)
    return path


@pytest.mark.parametrize(
    "entry, match",
    [
        (_s(b"general.alignment") + struct.pack("<I", 8) + _s(b"32"), "alignment"),
        (_s(b"general.alignment") + struct.pack("<II", 4, 24), "power of two"),
        (_s(b"general.alignment") + struct.pack("<II", 4, 0), "alignment"),
        (_s(b"general.architecture") + struct.pack("<II", 4, 7), "general.architecture"),
        (_s(b"unknown.block_count") + struct.pack("<I", 8) + _s(b"many"), "block_count"),
        (_s(b"unknown.block_count") + struct.pack("<Ii", 5, -3), "block_count"),
        (_s(b"unknown.context_length") + struct.pack("<IQ", 10, 2**63), "context_length"),
        (_s(b"unknown.block_count") + struct.pack("<I?", 7, True), "block_count"),
        (_s(b"tokenizer.chat_template") + struct.pack("<If", 6, 1.0), "chat_template"),
        (_s(b"bad\xff\xfekey") + struct.pack("<IB", 0, 1), "not UTF-8"),
        (_s(b"k") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 0, 0), "array of arrays"),
        (_s(b"k") + struct.pack("<IIQ", 9, 8, 2**62), "truncated"),
        (_s(b"k") + struct.pack("<IIQ", 9, 77, 3), "unknown type"),
        (_s(b"k") + struct.pack("<I", 99), "unknown metadata value type"),
        (_s(b"k" * 100_000), "key of 100,000 bytes"),
    ],
)
def test_crafted_metadata_is_refused_by_name(scratch: Path, entry: bytes, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        read_gguf_header(_kv_file(scratch, entry, tail=b"\0" * 64))


def test_deeply_nested_arrays_are_refused_without_recursion(scratch: Path) -> None:
    nested = struct.pack("<IQ", 9, 1) * 50_000  # each level an array holding one array
    entry = _s(b"k") + struct.pack("<I", 9) + nested
    with pytest.raises(ModelLoadError, match="array of arrays"):
        read_gguf_header(_kv_file(scratch, entry))


def test_duplicate_keys_and_tensors_are_refused(scratch: Path) -> None:
    entry = _s(b"k") + struct.pack("<IB", 0, 1)
    with pytest.raises(ModelLoadError, match="twice"):
        read_gguf_header(_kv_file(scratch, entry, entry, tail=b"\0" * 64))
    tensor = _s(b"t") + struct.pack("<IQIQ", 1, 32, 0, 0)
    with pytest.raises(ModelLoadError, match="twice"):
        read_gguf_header(_kv_file(scratch, n_tensors=2, tail=tensor * 2 + b"\0" * 512))


@pytest.mark.parametrize(
    "shape, ggml_type, offset, match",
    [
        ((32,), 0, 4, "alignment"),  # f32 data at offset 4: misaligned
        ((33,), 2, 0, "block"),  # q4_0 rows must be whole 32-element blocks
        ((2**40, 2**40), 0, 0, "truncated"),  # shape past the end of the file
        ((32,), 0, 2**63, "truncated"),  # offset past the end of the file
        ((2**64 - 1,) * 8, 0, 0, "truncated"),  # element count far beyond 64 bits
    ],
)
def test_tensor_table_past_the_file_is_refused(
    scratch: Path, shape: tuple[int, ...], ggml_type: int, offset: int, match: str
) -> None:
    tensor = _s(b"t") + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
    tensor += struct.pack("<IQ", ggml_type, offset)
    with pytest.raises(ModelLoadError, match=match):
        read_gguf_header(_kv_file(scratch, n_tensors=1, tail=tensor + b"\0" * 512))


def test_a_huge_string_value_is_skipped_not_loaded(scratch: Path) -> None:
    entry = _s(b"tokenizer.huggingface.json") + struct.pack("<I", 8) + _s(b"x" * (2 << 20))
    header = read_gguf_header(_kv_file(scratch, entry, tail=b"\0" * 64))
    assert header.metadata["tokenizer.huggingface.json"] == StringInfo(2 << 20)


def test_a_huge_claimed_array_fails_at_once(scratch: Path) -> None:
    # 2**40 strings claimed in a 1 MB file: refused before a single one is read
    entry = _s(b"k") + struct.pack("<IIQ", 9, 8, 2**40) + b"\0" * (1 << 20)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="truncated"):
        read_gguf_header(_kv_file(scratch, entry))
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "entry",
    [
        _s(b"llama.block_count") + struct.pack("<I", 8) + _s(b"many"),
        _s(b"llama.attention.head_count") + struct.pack("<IIQ", 9, 4, 2) + b"\1\0\0\0" * 2,
        _s(b"llama.embedding_length") + struct.pack("<Id", 12, 576.0),
    ],
)
def test_load_refuses_sizes_the_planner_cannot_read(scratch: Path, entry: bytes) -> None:
    """These reached the memory planner's int() as TypeError/ValueError before."""
    import edgeinfer

    arch = _s(b"general.architecture") + struct.pack("<I", 8) + _s(b"llama")
    with pytest.raises(ModelLoadError, match=r"llama\.\w"):
        edgeinfer.load(_kv_file(scratch, arch, entry, tail=b"\0" * 64))
