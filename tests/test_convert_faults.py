"""Converters against malformed input and faults: config.json and safetensors headers from
strangers (explicit classes and hypothesis), a full disk (a real small tmpfs), SIGKILL and
Ctrl-C mid-conversion. Every failure is a ConversionError, and nothing partial is left."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edgeinfer import ConversionError
from edgeinfer.converters import convert
from edgeinfer.converters.atomic import DiskFullError, atomic_output_file
from edgeinfer.converters.sources.hf_config import read_model_config
from edgeinfer.converters.sources.safetensors_reader import open_checkpoint

from .leakcheck import KillAtEnd
from .signals import sigint_default

pytest.importorskip("gguf", reason="needs the convert extra")

FAST = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "U8": 1}
_NP = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I64": "<i8", "U8": "u1"}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name)


# -- config.json ------------------------------------------------------------------------------


def _with_config(tiny_hf: Path, dest: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    """A copy of the tiny checkpoint whose config.json is ``edit(config)`` (None: removed)."""
    shutil.copytree(tiny_hf, dest)
    config = json.loads((dest / "config.json").read_text())
    new = edit(config)
    if new is None:
        (dest / "config.json").unlink()
    else:
        text = new if isinstance(new, str) else json.dumps(new)
        (dest / "config.json").write_text(text)
    return dest


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda c: {**c, key: value}


def _drop(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda c: {k: v for k, v in c.items() if k != key}


CONFIG_CASES = [
    ("missing", lambda c: None, "config.json"),
    ("not json", lambda c: "{not json", "not valid JSON"),
    ("array", lambda c: json.dumps([c]), "JSON object"),
    ("string", lambda c: json.dumps("llama"), "JSON object"),
    ("deep nesting", lambda c: "[" * 100_000 + "]" * 100_000, "config.json"),
    ("model_type number", _set("model_type", 7), "model_type"),
    ("rope_scaling list", _set("rope_scaling", [1]), "rope_scaling"),
    ("rope_theta NaN", lambda c: json.dumps(c)[:-1] + ', "rope_theta": NaN}', "rope_theta"),
    ("rope_theta zero", _set("rope_theta", 0), "rope_theta"),
    ("rope_theta text", _set("rope_theta", "1e4"), "rope_theta"),
    ("rms_norm_eps one", _set("rms_norm_eps", 1.0), "rms_norm_eps"),
    ("tied text", _set("tie_word_embeddings", "yes"), "tie_word_embeddings"),
    ("kv heads do not divide", _set("num_key_value_heads", 3), "num_key_value_heads"),
    ("odd head_dim", _set("head_dim", 15), "head_dim"),
    ("hidden not a multiple", lambda c: {**_drop("head_dim")(c), "hidden_size": 66}, "hidden"),
    ("hidden disagrees with the weights", _set("hidden_size", 96), "hidden_size 96"),
    ("eos text", _set("eos_token_id", "2"), "eos_token_id"),
    ("max positions negative", _set("max_position_embeddings", -1), "max_position_embeddings"),
]
for _key in ("num_attention_heads", "num_hidden_layers", "hidden_size", "vocab_size"):
    CONFIG_CASES += [
        (f"{_key} missing", _drop(_key), _key),
        (f"{_key} zero", _set(_key, 0), _key),
        (f"{_key} negative", _set(_key, -4), _key),
        (f"{_key} text", _set(_key, "4"), _key),
        (f"{_key} float", _set(_key, 4.0), _key),
        (f"{_key} bool", _set(_key, True), _key),
        (f"{_key} absurd", _set(_key, 10**30), _key),
    ]
CONFIG_CASES += [
    ("kv heads zero", _set("num_key_value_heads", 0), "num_key_value_heads"),
    ("kv heads negative", _set("num_key_value_heads", -2), "num_key_value_heads"),
    ("intermediate zero", _set("intermediate_size", 0), "intermediate_size"),
    ("intermediate missing", _drop("intermediate_size"), "intermediate_size"),
    ("intermediate text", _set("intermediate_size", "128"), "intermediate_size"),
    ("vocab disagrees with the weights", _set("vocab_size", 1000), "vocab_size 1000"),
    ("heads disagree with the weights", _set("num_attention_heads", 8), "shape"),
]


@pytest.mark.parametrize(("case", "edit", "field"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_is_a_conversion_error_before_writing(
    tiny_hf: Path, tmp_path: Path, case: str, edit: Any, field: str
) -> None:
    src = _with_config(tiny_hf, tmp_path / "src", edit)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConversionError, match=field):
        convert(src, out_dir / "x.gguf", to="gguf", quant="f32")
    # the ONNX route checks the same file before it writes; disagreements with the weights
    # (and the sizes transformers has defaults for) surface from the exporter
    exporter = "weights" in case or "intermediate missing" in case
    with pytest.raises(ConversionError, match="optimum could not export" if exporter else field):
        convert(src, out_dir / "x-onnx", to="onnx")
    assert list(out_dir.iterdir()) == []


def test_cli_prints_one_line_for_a_bad_config(tiny_hf: Path, tmp_path: Path) -> None:
    src = _with_config(tiny_hf, tmp_path / "src", _set("num_attention_heads", 0))
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "convert", str(src), "-o",
         str(tmp_path / "x.gguf"), "--to", "gguf"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_attention_heads" in lines[0], done.stderr
    assert not (tmp_path / "x.gguf").exists() and _leftovers(tmp_path) == []


_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.sampled_from([1, 2, 4, 8, 16, 64, 128, 400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_CONFIG_KEYS = [
    "model_type", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
    "num_hidden_layers", "vocab_size", "intermediate_size", "max_position_embeddings",
    "rope_theta", "rms_norm_eps", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "eos_token_id",
]  # fmt: skip
_BASE_CONFIG = {
    "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 400, "intermediate_size": 128,
}  # fmt: skip


@FAST
@given(
    changes=st.dictionaries(st.sampled_from(_CONFIG_KEYS), _JSON_VALUES, min_size=1, max_size=4),
    drop=st.lists(st.sampled_from(_CONFIG_KEYS), max_size=2),
)
def test_config_json_is_read_or_refused_by_field(changes: dict[str, Any], drop: list[str]) -> None:
    """Any config: a ModelConfig whose numbers hold together, or ConversionError naming a
    field that was changed or dropped."""
    config = {k: v for k, v in {**_BASE_CONFIG, **changes}.items() if k not in drop}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config))
        try:
            hp = read_model_config(path)
        except ConversionError as exc:
            assert any(key in str(exc) for key in [*changes, *drop]), str(exc)
            return
    assert hp.num_attention_heads >= 1 and hp.num_hidden_layers >= 1 and hp.vocab_size >= 1
    assert hp.num_attention_heads % hp.num_key_value_heads == 0
    assert hp.head_dim >= 2 and hp.head_dim % 2 == 0
    assert math.isfinite(hp.rope_theta) and hp.rope_theta > 0 and 0 < hp.rms_norm_eps < 1
    assert all(isinstance(i, int) and i >= 0 for i in hp.eos_token_ids)


# -- safetensors headers ----------------------------------------------------------------------


def _safetensors(header: dict[str, Any] | list[Any] | str, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, str) else json.dumps(header)
    body = raw.encode()
    return struct.pack("<Q", len(body)) + body + data


def _entry(dtype: str, shape: list[Any], start: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


_GOOD = {"a": _entry("F32", [2, 2], 0, 16), "b": _entry("F16", [4], 16, 24)}
HEADER_CASES: list[tuple[str, bytes, str]] = [
    ("overlap", _safetensors({**_GOOD, "b": _entry("F16", [4], 8, 16)}, bytes(24)), "overlap"),
    ("past the end", _safetensors(_GOOD, bytes(20)), "'b'"),
    ("reversed", _safetensors({"a": _entry("F32", [2], 8, 0)}, bytes(8)), "'a'"),
    ("size mismatch", _safetensors({"a": _entry("F32", [3], 0, 8)}, bytes(8)), "'a'.*needs"),
    ("negative dim", _safetensors({"a": _entry("F32", [-2], 0, 8)}, bytes(8)), "'a'"),
    ("absurd dims", _safetensors({"a": _entry("F32", [2**62, 2**62], 0, 8)}, bytes(8)), "'a'"),
    ("rank 64", _safetensors({"a": _entry("F32", [1] * 64, 0, 4)}, bytes(4)), "'a'"),
    ("float dim", _safetensors({"a": _entry("F32", [2.0], 0, 8)}, bytes(8)), "'a'"),
    ("bool offset", _safetensors({"a": _entry("F32", [1], False, 4)}, bytes(4)), "'a'"),
    ("text offset", _safetensors({"a": _entry("F32", [1], "0", 4)}, bytes(4)), "'a'"),
    ("null offsets", _safetensors({"a": {"dtype": "F32", "shape": [1]}}, bytes(4)), "'a'"),
    ("unknown dtype", _safetensors({"a": _entry("F33", [1], 0, 4)}, bytes(4)), "'a'.*F33"),
    ("entry not object", _safetensors({"a": [1, 2]}, bytes(4)), "'a'"),
    ("header length", struct.pack("<Q", 10**6) + b"{}", "header length"),
    ("huge header length", struct.pack("<Q", 2**63) + b"{}" + bytes(64), "header length"),
    ("too short", b"\x01\x00", "too short"),
    ("not json", _safetensors("{nope"), "header"),
    ("not utf-8", _safetensors('{"a": 1}')[:9] + b"\xff\xfe" + b"}", "header"),
    ("array header", _safetensors([1, 2]), "not a JSON object"),
    ("deep nesting", _safetensors("[" * 50_000 + "]" * 50_000), "header"),
    ("duplicate names", _safetensors(
        '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        '"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', bytes(8)), "twice"),
    ("metadata not object", _safetensors({"__metadata__": [1], **_GOOD}, bytes(24)), "metadata"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "blob", "match"), HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_malformed_safetensors_headers(tmp_path: Path, case: str, blob: bytes, match: str) -> None:
    (tmp_path / "model.safetensors").write_bytes(blob)
    with pytest.raises(ConversionError, match=match), open_checkpoint(tmp_path):
        pass


def test_shards_and_their_index_are_checked(tmp_path: Path) -> None:
    one = _safetensors({"a": _entry("F32", [1], 0, 4)}, bytes(4))
    (tmp_path / "s1.safetensors").write_bytes(one)
    (tmp_path / "s2.safetensors").write_bytes(one)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(ConversionError, match="'a' is in both"), open_checkpoint(tmp_path):
        pass
    (tmp_path.parent / "outside.safetensors").write_bytes(one)
    for weight_map in ({"a": "../outside.safetensors"}, {"a": "/etc/passwd"}, {"a": 3}, [1]):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ConversionError, match=r"index|inside"), open_checkpoint(tmp_path):
            pass
    (tmp_path / "link.safetensors").symlink_to(tmp_path.parent / "outside.safetensors")
    index.write_text(json.dumps({"weight_map": {"a": "link.safetensors"}}))
    with pytest.raises(ConversionError, match="inside"), open_checkpoint(tmp_path):
        pass


def test_bad_weights_in_a_checkpoint_fail_the_conversion_before_writing(
    tiny_hf: Path, tmp_path: Path
) -> None:
    src = _with_config(tiny_hf, tmp_path / "src", lambda c: c)
    weights = src / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    weights.write_bytes(bytes(blob[: len(blob) // 2]))  # truncated: tensors past the end
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for to in ("gguf", "onnx"):
        with pytest.raises(ConversionError, match="outside the file"):
            convert(src, out_dir / f"x.{to}", to=to)
    assert list(out_dir.iterdir()) == []


@st.composite
def _tensors(draw: st.DrawFn) -> list[tuple[str, str, tuple[int, ...]]]:
    names = draw(
        st.lists(
            st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__"),
            unique=True,
            max_size=5,
        )
    )
    shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
    return [(n, draw(st.sampled_from(sorted(_ITEMSIZE))), draw(shapes)) for n in names]


def _build(tensors: list[tuple[str, str, tuple[int, ...]]], seed: int) -> tuple[dict, bytes]:
    rng = np.random.default_rng(seed)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, dtype, shape in tensors:
        n = math.prod(shape) * _ITEMSIZE[dtype]
        header[name] = _entry(dtype, list(shape), len(data), len(data) + n)
        data += rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return header, data


def _mutate(header: dict, data: bytes, how: str, draw: Any) -> bytes:
    names = [k for k in header if k != "__metadata__"]
    blob = _safetensors(header, data)
    if how == "truncate":
        return blob[: draw(st.integers(0, len(blob)))]
    if how == "flip":
        at = draw(st.integers(0, len(blob) - 1))
        return blob[:at] + bytes([blob[at] ^ draw(st.integers(1, 255))]) + blob[at + 1 :]
    if how == "length":
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + blob[8:]
    if how == "field" and names:
        entry = header[draw(st.sampled_from(names))]
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        entry[key] = draw(_JSON_VALUES | st.lists(st.integers(-(2**65), 2**65), max_size=3))
    if how == "shift" and names:
        entry = header[draw(st.sampled_from(names))]
        delta = draw(st.integers(-64, 64))
        entry["data_offsets"] = [o + delta for o in entry["data_offsets"]]
    if how == "junk":
        return blob + draw(st.binary(max_size=64))
    return _safetensors(header, data)


@FAST
@given(tensors=_tensors(), how=st.sampled_from(
    ["none", "truncate", "flip", "length", "field", "shift", "junk"]), data=st.data())  # fmt: skip
def test_any_safetensors_file_is_read_consistently_or_refused(
    tensors: list[tuple[str, str, tuple[int, ...]]], how: str, data: st.DataObject
) -> None:
    header, payload = _build(tensors, seed=len(tensors))
    blob = _mutate(json.loads(json.dumps(header)), payload, how, data.draw)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        path.write_bytes(blob)
        try:
            with open_checkpoint(Path(folder)) as index:
                _check_consistent(index, len(blob), header, payload, how)
            event(f"{how}: read")
        except ConversionError:
            event(f"{how}: refused")
            assert how != "none" and how != "junk"


@pytest.mark.parametrize("shape", [[0, 2**61], [0, 2**40, 2**40], [2**47, 0, 4]])
def test_an_empty_tensor_with_a_huge_dimension_is_refused_cleanly(
    shape: list[int], tmp_path: Path
) -> None:
    """Zero elements, but a dimension numpy cannot hold: a ConversionError, not numpy's
    ValueError (found by the property above: BF16 [0, 2**61])."""
    header = json.dumps({"0": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}})
    raw = header.encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ConversionError, match="larger than any tensor"):
        with open_checkpoint(tmp_path) as index:
            index.read("0")


def _check_consistent(index: Any, size: int, header: dict, payload: bytes, how: str) -> None:
    """Entries inside the file, sized by dtype x shape, not overlapping; an unchanged file
    reads back exactly what was written."""
    spans = []
    for name, entry in index.entries.items():
        assert 8 <= entry.start <= entry.end <= size
        assert entry.nbytes == math.prod(entry.shape) * _ITEMSIZE[entry.dtype]
        spans.append((entry.start, entry.end))
        if entry.dtype not in ("F32", "F16", "F64", "BF16"):
            with pytest.raises(ConversionError, match="only F32"):
                index.read(name)
            continue
        got = index.read(name)
        assert got.shape == entry.shape
        if how in ("none", "junk"):
            start, end = header[name]["data_offsets"]
            stored = np.frombuffer(payload[start:end], dtype=_NP[entry.dtype])
            if entry.dtype == "BF16":
                stored = (stored.astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(got.reshape(-1), stored)
    if how in ("none", "junk"):
        assert sorted(index.entries) == sorted(k for k in header if k != "__metadata__")
    spans = sorted(s for s in spans if s[1] > s[0])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@FAST
@given(
    arrays=st.lists(
        st.tuples(
            st.sampled_from(["float32", "float16", "float64"]),
            st.lists(st.integers(0, 4), max_size=3),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_files_written_by_the_safetensors_library_read_back_exactly(
    arrays: list[tuple[str, list[int]]],
) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {
        f"t{i}": rng.standard_normal(shape).astype(dtype) for i, (dtype, shape) in enumerate(arrays)
    }
    with tempfile.TemporaryDirectory() as folder:
        save_file(tensors, str(Path(folder) / "model.safetensors"))
        with open_checkpoint(Path(folder)) as index:
            assert sorted(index.names()) == sorted(tensors)
            for name, expected in tensors.items():
                np.testing.assert_array_equal(index.read(name), expected)


# -- a full disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """size in bytes -> a freshly mounted tmpfs of that size (unmounted afterwards)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs Linux and root")
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_is_refused_before_writing_and_the_cli_says_so(
    tiny_hf: Path, small_disk: Callable[[int], Path]
) -> None:
    disk = small_disk(64 * 1024)
    out = disk / "tiny.gguf"
    out.write_bytes(b"an existing model")
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "convert", str(tiny_hf), "-o", str(out),
         "--to", "gguf", "--quant", "f32", "--overwrite"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]  # after the stage lines: one error line
    assert last.startswith("edgeinfer: error: not enough disk space") and "MB" in last
    assert "Traceback" not in done.stderr
    assert out.read_bytes() == b"an existing model"
    assert sorted(p.name for p in disk.iterdir()) == ["tiny.gguf"]


@pytest.mark.parametrize("quant", ["f32", "q4_0"])
def test_disk_filling_up_mid_write_leaves_nothing(
    tiny_hf: Path,
    small_disk: Callable[[int], Path],
    monkeypatch: pytest.MonkeyPatch,
    quant: str,
) -> None:
    """The space check passes (as when another program fills the disk meanwhile): the
    write itself meets ENOSPC."""
    from edgeinfer.converters.gguf import writer as gguf_export

    monkeypatch.setattr(gguf_export, "ensure_free_space", lambda out, needed: None)
    disk = small_disk(128 * 1024)
    out = disk / "tiny.gguf"
    out.write_bytes(b"an existing model")
    with pytest.raises(DiskFullError, match=f"disk holding {disk} is full"):
        convert(tiny_hf, out, to="gguf", quant=quant, overwrite=True)
    assert out.read_bytes() == b"an existing model"
    assert sorted(p.name for p in disk.iterdir()) == ["tiny.gguf"]


def test_onnx_route_on_a_full_disk(
    tiny_hf: Path, small_disk: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgeinfer.converters.onnx import optimum as pipeline

    disk = small_disk(256 * 1024)
    with pytest.raises(DiskFullError, match="not enough disk space"):
        convert(tiny_hf, disk / "onnx", quant="fp32")
    assert list(disk.iterdir()) == []
    monkeypatch.setattr(pipeline, "ensure_free_space", lambda out, needed: None)
    with pytest.raises(DiskFullError, match="full"):
        convert(tiny_hf, disk / "onnx", quant="fp32")
    assert list(disk.iterdir()) == []


def _file_size_limit(limit: int) -> Callable[[], None]:
    """preexec_fn for a child whose files may not grow past ``limit`` bytes: SIGXFSZ is
    ignored there, so a write past the limit fails with EFBIG instead of killing it."""

    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE is POSIX")
@pytest.mark.parametrize(
    ("to", "quant", "limit"),
    [("gguf", "f32", 64 * 1024), ("gguf", "q4_0", 16 * 1024), ("onnx", "fp32", 64 * 1024)],
)
def test_a_write_cut_short_by_a_file_size_limit_leaves_nothing_and_says_so(
    tiny_hf: Path, tmp_path: Path, to: str, quant: str, limit: int
) -> None:
    """Runs for every user (no mount): the space check passes and the write itself fails
    part way (EFBIG), as when a quota or another program stops it."""
    out = tmp_path / ("tiny.gguf" if to == "gguf" else "tiny-onnx")
    old = out / "old.txt" if to == "onnx" else out
    old.parent.mkdir(exist_ok=True)
    old.write_bytes(b"an existing model")
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "convert", str(tiny_hf), "-o", str(out),
         "--to", to, "--quant", quant, "--overwrite"],
        capture_output=True, text=True, check=False, timeout=300,
        preexec_fn=_file_size_limit(limit),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # after the stage lines: one error line
    assert last.startswith("edgeinfer: error: "), last
    assert "nothing was written" in last, last  # a ConversionError, typed, saying so
    assert old.read_bytes() == b"an existing model"
    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    if to == "onnx":
        assert sorted(p.name for p in out.iterdir()) == ["old.txt"]


def test_write_errors_are_typed_and_only_a_full_disk_is_called_full(tmp_path: Path) -> None:
    out = tmp_path / "x.gguf"
    for error, kind in [(OSError(28, "No space left on device"), DiskFullError),
                        (PermissionError(13, "Permission denied"), ConversionError)]:  # fmt: skip
        with pytest.raises(kind) as caught, atomic_output_file(out, overwrite=False) as partial:
            partial.write_bytes(b"half")
            raise error
        assert (kind is DiskFullError) == isinstance(caught.value, DiskFullError)
        assert list(tmp_path.iterdir()) == []


# -- SIGKILL and Ctrl-C -----------------------------------------------------------------------


def _start_cli(src: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "edgeinfer.cli", "convert", str(src), "-o", str(out),
         "--overwrite", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=sigint_default,
    )  # fmt: skip


def _wait_for_partial(proc: subprocess.Popen[bytes], out: Path, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = [
            p
            for p in out.parent.glob(f".{out.name}.partial-*")
            if p.is_file() or (p / "_work").exists()  # an ONNX folder: the export began
        ]
        if found:
            return found[0]
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"no partial output appeared (exit {proc.poll()})")


@pytest.mark.parametrize(("to", "quant"), [("gguf", "f32"), ("gguf", "q4_0"), ("onnx", "fp32")])
def test_sigkill_mid_conversion_keeps_the_old_output_and_the_next_run_sweeps(
    tiny_hf: Path, tmp_path: Path, to: str, quant: str, kill_at_end: KillAtEnd
) -> None:
    out = tmp_path / ("tiny.gguf" if to == "gguf" else "tiny-onnx")
    old = out / "old.txt" if to == "onnx" else out
    old.parent.mkdir(exist_ok=True)
    old.write_bytes(b"an existing model")
    proc = kill_at_end(_start_cli(tiny_hf, out, "--to", to, "--quant", quant))
    partial = _wait_for_partial(proc, out)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert old.read_bytes() == b"an existing model"
    assert partial.exists()  # what a killed process leaves ...
    # a random model loses its answers to 4 bits: this checks files, not accuracy
    lax = {"min_top1_agreement": 0.0, "min_greedy_agreement": 0.0, "validation_tokens": 2}
    convert(tiny_hf, out, to=to, quant=quant, overwrite=True, **lax)
    assert _leftovers(tmp_path) == []  # ... the next conversion sweeps
    assert not old.exists() or old.read_bytes()[:4] == b"GGUF"


def test_ctrl_c_mid_conversion_leaves_nothing(
    tiny_hf: Path, tmp_path: Path, kill_at_end: KillAtEnd
) -> None:
    out = tmp_path / "tiny.gguf"
    out.write_bytes(b"an existing model")
    proc = kill_at_end(_start_cli(tiny_hf, out, "--to", "gguf", "--quant", "f32"))
    _wait_for_partial(proc, out)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr
    assert out.read_bytes() == b"an existing model"
    assert _leftovers(tmp_path) == []


def _interrupt_after(calls: int, real: Callable[..., Any]) -> Callable[..., Any]:
    count = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] >= calls:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    ("to", "quant", "target"),
    [
        ("gguf", "f32", "converters.sources.safetensors_reader.SafetensorsIndex.read"),
        ("gguf", "q4_0", "converters.gguf.route.quantize_gguf"),
        ("gguf", "f16", "converters.gguf.route._validate"),
        ("onnx", "fp32", "converters.onnx.export.export_onnx"),
    ],
)
def test_keyboard_interrupt_mid_conversion_leaves_nothing(
    tiny_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str, quant: str,
    target: str,
) -> None:  # fmt: skip
    import importlib

    module_name, _, attr = f"edgeinfer.{target}".rpartition(".")
    try:
        owner: Any = importlib.import_module(module_name)
    except ModuleNotFoundError:  # a class attribute
        module_name, _, cls = module_name.rpartition(".")
        owner = getattr(importlib.import_module(module_name), cls)
    monkeypatch.setattr(owner, attr, _interrupt_after(3 if "read" in attr else 1,
                                                       getattr(owner, attr)))  # fmt: skip
    out = tmp_path / ("tiny.gguf" if to == "gguf" else "tiny-onnx")
    out.write_bytes(b"an existing model") if to == "gguf" else out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_hf, out, to=to, quant=quant, overwrite=True)
    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    if to == "gguf":
        assert out.read_bytes() == b"an existing model"
