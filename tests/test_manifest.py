"""ONNX model folders from strangers: the manifest, the files it names, the graph behind it.

Every malformed or inconsistent folder must fail at load with ModelLoadError naming the
field — never an untyped error, never an error at generation, never a file outside the folder.
The folders are tiny hand-built decoder graphs (onnx helper, no torch).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer import ModelLoadError
from edgeinfer.config import LoadConfig
from edgeinfer.files.manifest import (
    ARCHITECTURE_LIMITS,
    MANIFEST_NAME,
    NOT_CHECKED,
    Manifest,
    parse_manifest,
    resolve_inside,
)

onnx = pytest.importorskip("onnx", reason="building test graphs needs the onnx package")
pytest.importorskip("onnxruntime", reason="needs the onnx extra")
pytest.importorskip("tokenizers", reason="needs the onnx extra")

VALID: dict[str, Any] = {
    "format": "onnx",
    "model_file": "model.onnx",
    "architecture": {
        "model_type": "tiny",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 4,
        "hidden_size": 8,
        "max_context": 64,
        "vocab_size": 32,
        "kv_dtype": "float32",
    },
    "tokenizer_file": "tokenizer.json",
    "chat_template_file": "chat_template.jinja",
    "bos_token": None,
    "eos_token": "t0",
    "eos_token_ids": [0],
    "has_position_ids": True,
    "source": {},
    "quantization": {"method": "fp32"},
    "validation": {},
    "format_version": 1,
}


# -- tiny model folders --------------------------------------------------------------------


def _graph(
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 4,
    vocab: int = 32,
    kv_type: int = 1,  # TensorProto.FLOAT; 10 is FLOAT16
    ids_type: int = 7,  # TensorProto.INT64; 6 is INT32
) -> Any:
    """A decoder graph: logits = embed(ids) @ W, present = concat(past, embed(ids) as KV)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    width = heads * head_dim
    inits = [
        numpy_helper.from_array(rng.standard_normal((vocab, width)).astype(np.float32), "E"),
        numpy_helper.from_array(rng.standard_normal((width, vocab)).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([1, -1, heads, head_dim], dtype=np.int64), "kv_shape"),
    ]
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["x"]),  # x: [1, S, H*D]
        helper.make_node("MatMul", ["x", "W"], ["logits"]),  # [1, S, V]
        helper.make_node("Reshape", ["x", "kv_shape"], ["xr"]),
        helper.make_node("Transpose", ["xr"], ["kv32"], perm=[0, 2, 1, 3]),  # [1, H, S, D]
        helper.make_node("Cast", ["kv32"], ["kv"], to=kv_type),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", ids_type, [1, "S"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "T"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "S"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "S", vocab])]
    for layer in range(layers):
        for kind in ("key", "value"):
            past, present = f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"
            inputs.append(helper.make_tensor_value_info(past, kv_type, [1, heads, "P", head_dim]))
            outputs.append(
                helper.make_tensor_value_info(present, kv_type, [1, heads, "T", head_dim])
            )
            nodes.append(helper.make_node("Concat", [past, "kv"], [present], axis=2))
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _tokenizer(path: Path, size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def make_folder(
    folder: Path,
    manifest: dict[str, Any] | None = None,
    *,
    tokens: int = 32,
    external: bool = False,
    **graph: Any,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model = _graph(**graph)
    if external:
        onnx.save_model(
            model,
            str(folder / "model.onnx"),
            save_as_external_data=True,
            location="model.onnx.data",
            size_threshold=100,  # the weights; kv_shape stays inline for shape inference
        )
    else:
        onnx.save_model(model, str(folder / "model.onnx"))
    _tokenizer(folder / "tokenizer.json", tokens)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest or VALID))
    return folder


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


_DELETE = object()


def _with(path: str, value: Any) -> dict[str, Any]:
    """VALID with ``path`` ("architecture.num_layers") set to ``value`` (or removed)."""
    data = copy.deepcopy(VALID)
    *parents, key = path.split(".")
    node = data
    for parent in parents:
        node = node[parent]
    if value is _DELETE:
        node.pop(key, None)
    else:
        node[key] = value
    return data


# -- the folder that is right loads and runs ------------------------------------------------


@pytest.mark.parametrize("external", [False, True])
def test_a_consistent_tiny_folder_loads_and_generates(tmp_path: Path, external: bool) -> None:
    folder = make_folder(tmp_path / "m", external=external)
    with edgeinfer.load(folder, device="cpu", threads=1) as model:
        result = model.generate("t3 t4 t5", max_new_tokens=4, temperature=0)
        assert result.finish_reason in ("stop", "length")
        assert all(0 <= t < 32 for t in result.token_ids)


# -- the manifest's JSON: one function checks it all ----------------------------------------


@pytest.mark.parametrize(
    "path, value, match",
    [
        ("format_version", "1", "format_version"),
        ("format_version", 1.0, "format_version"),
        ("format_version", True, "format_version"),
        ("format_version", 0, "format_version"),
        ("format_version", 2, "newer edgeinfer"),
        ("format", "gguf", "format"),
        ("format", _DELETE, "format"),
        ("model_file", _DELETE, "model_file"),
        ("model_file", 3, "model_file"),
        ("model_file", ["model.onnx"], "model_file"),
        ("architecture", [], "architecture"),
        ("architecture", "tiny", "architecture"),
        ("architecture", _DELETE, "architecture"),
        ("architecture.num_layers", -3, r"architecture\.num_layers=-3 must be an integer"),
        ("architecture.num_layers", 0, "architecture.num_layers"),
        ("architecture.num_layers", 10**9, "architecture.num_layers"),
        ("architecture.num_layers", "2", "architecture.num_layers"),
        ("architecture.num_layers", 2.0, "architecture.num_layers"),
        ("architecture.num_layers", True, "architecture.num_layers"),
        ("architecture.num_layers", None, "architecture.num_layers"),
        ("architecture.num_layers", _DELETE, "architecture.num_layers"),
        ("architecture.num_kv_heads", 0, "architecture.num_kv_heads"),
        ("architecture.head_dim", [4], "architecture.head_dim"),
        ("architecture.hidden_size", -8, "architecture.hidden_size"),
        ("architecture.max_context", 2**40, "architecture.max_context"),
        ("architecture.vocab_size", 0, "architecture.vocab_size"),
        ("architecture.vocab_size", 1e9, "architecture.vocab_size"),
        ("architecture.kv_dtype", "bfloat16", "architecture.kv_dtype"),
        ("architecture.kv_dtype", 4, "architecture.kv_dtype"),
        ("architecture.model_type", None, "architecture.model_type"),
        ("architecture.model_type", {"a": 1}, "architecture.model_type"),
        ("eos_token_ids", ["0"], "eos_token_ids"),
        ("eos_token_ids", [True], "eos_token_ids"),
        ("eos_token_ids", [-1], "eos_token_ids"),
        ("eos_token_ids", [32], "eos_token_ids"),  # out of the vocabulary (32 ids)
        ("eos_token_ids", [0.0], "eos_token_ids"),
        ("eos_token_ids", [[0]], "eos_token_ids"),
        ("eos_token_ids", 0, "eos_token_ids"),
        ("eos_token_ids", "0", "eos_token_ids"),
        ("has_position_ids", "yes", "has_position_ids"),
        ("has_position_ids", 1, "has_position_ids"),
        ("bos_token", 5, "bos_token"),
        ("eos_token", ["t0"], "eos_token"),
        ("source", [], "source"),
        ("quantization", "int8", "quantization"),
        ("quantization.method", 8, "quantization.method"),
        ("validation", None, "validation"),
    ],
)
def test_wrong_values_are_refused_naming_the_field(path: str, value: Any, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        parse_manifest(_with(path, value))


@pytest.mark.parametrize("data", [[], [VALID], "onnx", 3, 2.5, None, True])
def test_a_manifest_that_is_not_an_object_is_refused(data: Any) -> None:
    with pytest.raises(ModelLoadError, match="must be a JSON object"):
        parse_manifest(data)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # nesting past the recursion limit
        (b'{"format": "onnx", "architecture": {"num_layers": NaN}}', "num_layers"),
        (b" " * (2 << 20), "not a manifest"),
    ],
)
def test_unreadable_manifests_are_refused(tmp_path: Path, content: bytes, match: str) -> None:
    (tmp_path / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(ModelLoadError, match=match):
        Manifest.read(tmp_path)


def test_a_manifest_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).mkdir()
    with pytest.raises(ModelLoadError):
        Manifest.read(tmp_path)


def test_unknown_keys_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    data = _with("architecture.rope_theta", 10000.0) | {"future_field": [1, 2]}
    with caplog.at_level(logging.WARNING, logger="edgeinfer.files.manifest"):
        manifest = parse_manifest(data)
    assert manifest.architecture.num_layers == 2
    assert "future_field" in caplog.text and "architecture.rope_theta" in caplog.text


def test_what_the_converter_writes_reads_back(tmp_path: Path) -> None:
    report = {"passed": True, "top1_agreement": 0.945, "reference": "m.gguf through llama.cpp"}
    manifest = dataclasses.replace(parse_manifest(VALID), validation=report)
    manifest.write(tmp_path)
    assert Manifest.read(tmp_path) == manifest
    assert (
        manifest.validation_summary() == "validated against m.gguf through llama.cpp, top-1 94.5%"
    )


def test_a_folder_written_without_a_check_says_so(tmp_path: Path) -> None:
    """A folder built with no comparison (load()'s automatic transcode, an [onnx]-only
    install) records that it was not validated, and every reader is told."""
    parse_manifest(VALID).write(tmp_path)
    read = Manifest.read(tmp_path)
    assert read.validation == {"skipped": NOT_CHECKED}
    assert read.validation_summary().startswith("not validated")
    skipped = {"skipped": "answers not compared: llama.cpp is not installed"}
    assert (
        "llama.cpp is not installed"
        in parse_manifest({**VALID, "validation": skipped}).validation_summary()
    )
    failed = {**VALID, "validation": {"passed": False, "top1_agreement": 0.1}}
    assert parse_manifest(failed).validation_summary() == "failed validation"


# -- files the manifest names stay inside the folder ----------------------------------------

OUTSIDE_NAMES = [
    "../secret.txt",
    "sub/../../secret.txt",
    "/etc/passwd",
    "C:\\secret.txt",
    "..\\secret.txt",
    "a\0b",
    "",
    " ",
    ".",
]


@pytest.mark.parametrize("key", ["model_file", "tokenizer_file", "chat_template_file"])
@pytest.mark.parametrize("name", OUTSIDE_NAMES)
def test_names_leaving_the_folder_are_refused(tmp_path: Path, key: str, name: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "secret.txt").write_text("do not read")
    (folder / MANIFEST_NAME).write_text(json.dumps(_with(key, name)))
    with pytest.raises(ModelLoadError, match=key):
        Manifest.read(folder)


@pytest.mark.parametrize("key", ["model_file", "tokenizer_file", "chat_template_file"])
def test_symlinks_leading_out_are_refused(tmp_path: Path, key: str) -> None:
    folder = tmp_path / "m"
    (folder / "sub").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("do not read")
    os.symlink(tmp_path / "secret.txt", folder / "link.txt")
    os.symlink(tmp_path, folder / "sub" / "up")
    for name in ("link.txt", "sub/up/secret.txt"):
        (folder / MANIFEST_NAME).write_text(json.dumps(_with(key, name)))
        with pytest.raises(ModelLoadError, match=f"{key}.*outside the model folder"):
            Manifest.read(folder)


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ModelLoadError, match="tokenizer_file"):
        resolve_inside(tmp_path, "a", "tokenizer_file")


def test_a_symlink_inside_the_folder_is_fine(tmp_path: Path) -> None:
    (tmp_path / "real.json").write_text("{}")
    os.symlink(tmp_path / "real.json", tmp_path / "tokenizer.json")
    assert resolve_inside(tmp_path, "tokenizer.json", "k") == (tmp_path / "real.json").resolve()


def test_the_chat_template_never_comes_from_outside(tmp_path: Path, scratch: Path) -> None:
    """The reported leak: a file outside the folder came back as the chat template. The
    backend checks again, for manifests built in code (the converter's validation)."""
    from edgeinfer.machine.inventory import devices
    from edgeinfer.machine.policy import plan_providers
    from edgeinfer.runtimes.onnxruntime import open_backend

    folder = make_folder(tmp_path / "m")
    (tmp_path / "secret.txt").write_text("SECRET")
    (folder / MANIFEST_NAME).write_text(json.dumps(_with("chat_template_file", "../secret.txt")))
    with pytest.raises(ModelLoadError, match="chat_template_file"):
        edgeinfer.load(folder, device="cpu")
    os.symlink(tmp_path / "secret.txt", folder / "template.jinja")
    manifest = dataclasses.replace(parse_manifest(VALID), chat_template_file="template.jinja")
    cpu = plan_providers(devices(), "onnx", "cpu").candidates[0]
    with pytest.raises(ModelLoadError, match="chat_template_file"):
        open_backend(folder, LoadConfig(context_length=64), manifest, cpu)


@pytest.mark.parametrize("key", ["model_file", "tokenizer_file"])
def test_a_fifo_or_missing_file_is_refused_without_blocking(tmp_path: Path, key: str) -> None:
    folder = make_folder(tmp_path / "m")
    name = VALID[key]
    (folder / name).unlink()
    with pytest.raises(ModelLoadError, match=key):
        edgeinfer.load(folder, device="cpu")
    os.mkfifo(folder / name)
    with pytest.raises(ModelLoadError, match=key):
        edgeinfer.load(folder, device="cpu")


def test_a_fifo_as_the_manifest_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / MANIFEST_NAME)
    with pytest.raises(ModelLoadError, match="not a regular file"):
        Manifest.read(tmp_path)


def test_a_chat_template_that_is_not_text_is_refused(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m")
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe\xfa not utf-8")
    with pytest.raises(ModelLoadError, match="chat_template_file"):
        edgeinfer.load(folder, device="cpu")


# -- the graph's external data ---------------------------------------------------------------


def _point_external_data(folder: Path, location: str) -> None:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    (folder / "model.onnx").write_bytes(model.SerializeToString())


@pytest.mark.parametrize("location", ["../model.onnx.data", "/tmp/model.onnx.data", "sub/../../x"])
def test_external_data_outside_the_folder_is_refused(tmp_path: Path, location: str) -> None:
    folder = make_folder(tmp_path / "m", external=True)
    (folder / "model.onnx.data").rename(tmp_path / "model.onnx.data")
    _point_external_data(folder, location)
    with pytest.raises(ModelLoadError, match="external data location"):
        edgeinfer.load(folder, device="cpu")


def test_external_data_through_a_symlink_out_is_refused(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", external=True)
    (folder / "model.onnx.data").rename(tmp_path / "weights.bin")
    os.symlink(tmp_path / "weights.bin", folder / "model.onnx.data")
    with pytest.raises(ModelLoadError, match=r"external data location.*outside"):
        edgeinfer.load(folder, device="cpu")


def test_external_data_locations_equal_what_onnx_finds(tmp_path: Path) -> None:
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    from edgeinfer.files.onnx_graph import external_data_locations

    folder = make_folder(tmp_path / "m", external=True)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    expected = {
        entry.value
        for tensor in _get_all_tensors(model)
        if uses_external_data(tensor)
        for entry in tensor.external_data
        if entry.key == "location"
    }
    assert set(external_data_locations(folder / "model.onnx")) == expected == {"model.onnx.data"}
    make_folder(tmp_path / "inline")
    assert external_data_locations(tmp_path / "inline" / "model.onnx") == []


@settings(max_examples=300, deadline=1000, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    noise=st.binary(max_size=64),
)
def test_damaged_graphs_give_locations_or_model_load_error(
    scratch: Path, edits: list[tuple[int, int]], cut: int | None, noise: bytes
) -> None:
    """The protobuf walk over a mutated graph: a list of names, or ModelLoadError."""
    from edgeinfer.files.onnx_graph import external_data_locations

    source = scratch / "walk" / "model.onnx"
    if not source.is_file():
        make_folder(source.parent, external=True)
    data = bytearray(source.read_bytes())
    for where, byte in edits:
        data[where % len(data)] = byte
    data = data[: cut % (len(data) + 1)] if cut is not None else data + noise
    target = scratch / "walk-fuzz.onnx"
    target.write_bytes(bytes(data) or b"\0")
    try:
        assert all(isinstance(x, str) for x in external_data_locations(target))
    except ModelLoadError:
        pass


@pytest.mark.parametrize("data", [b"\x0a\xff\xff\xff\xff\x0f", b"\x3a\x05abc", b"\xff" * 12])
def test_a_damaged_graph_is_a_model_load_error(tmp_path: Path, data: bytes) -> None:
    folder = make_folder(tmp_path / "m")
    (folder / "model.onnx").write_bytes(data)
    with pytest.raises(ModelLoadError):
        edgeinfer.load(folder, device="cpu")


# -- the manifest must describe the graph it sits beside -------------------------------------


@pytest.mark.parametrize(
    "graph, tokens, match",
    [
        ({"vocab": 40}, 32, r"architecture\.vocab_size=32 disagrees.*logits"),
        ({"layers": 3}, 32, r"architecture\.num_layers=2 disagrees.*3 past_key_values"),
        ({"layers": 1}, 32, r"architecture\.num_layers=2 disagrees.*1 past_key_values"),
        ({"heads": 1, "head_dim": 8}, 32, r"architecture\.num_kv_heads=2 disagrees"),
        ({"heads": 4, "head_dim": 2}, 32, r"architecture\.num_kv_heads=2 disagrees"),
        ({"head_dim": 8}, 32, r"architecture\.head_dim=4 disagrees"),
        ({"kv_type": 10}, 32, r"architecture\.kv_dtype='float32' disagrees"),
        ({"ids_type": 6}, 32, "input_ids is tensor.int32"),
        ({}, 40, r"architecture\.vocab_size=32 is smaller than the tokenizer"),
    ],
)
def test_a_manifest_that_disagrees_with_its_graph_fails_at_load(
    tmp_path: Path, graph: dict[str, Any], tokens: int, match: str
) -> None:
    folder = make_folder(tmp_path / "m", tokens=tokens, **graph)
    with pytest.raises(ModelLoadError, match=match):
        edgeinfer.load(folder, device="cpu")


# -- hypothesis: whatever the manifest holds, a valid Manifest or ModelLoadError -------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 4, 32, 64, -1, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["../x", "/etc/passwd", "model.onnx", "float16", "onnx", "a\0b", ""]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [*VALID, *(f"architecture.{k}" for k in VALID["architecture"])]
MANIFEST_FUZZ = settings(
    max_examples=400,
    deadline=1000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _holds(manifest: Manifest) -> None:
    """What a Manifest that passed validation promises its readers."""
    arch = manifest.architecture
    for key, high in ARCHITECTURE_LIMITS.items():
        value = getattr(arch, key)
        assert type(value) is int and 1 <= value <= high
    assert arch.kv_dtype in ("float32", "float16") and isinstance(arch.model_type, str)
    assert all(type(t) is int and 0 <= t < arch.vocab_size for t in manifest.eos_token_ids)
    assert isinstance(manifest.has_position_ids, bool)
    assert isinstance(manifest.quantization.get("method", ""), str)
    assert type(manifest.format_version) is int


def _read_text(folder: Path, text: str) -> None:
    (folder / MANIFEST_NAME).write_text(text, encoding="utf-8")
    try:
        manifest = Manifest.read(folder)
    except ModelLoadError:
        return
    _holds(manifest)
    for name, key in manifest.named_files():
        assert resolve_inside(folder, name, key).is_relative_to(folder.resolve())


@MANIFEST_FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(FIELDS), json_values), min_size=1, max_size=4))
def test_valid_manifests_with_random_values(scratch: Path, changes: list[tuple[str, Any]]) -> None:
    data = copy.deepcopy(VALID)
    for path, value in changes:
        *parents, key = path.split(".")
        node = data.get("architecture") if parents else data
        if isinstance(node, dict):
            node[key] = value
    _read_text(scratch, json.dumps(data))


@MANIFEST_FUZZ
@given(data=json_values)
def test_random_json_as_a_manifest(scratch: Path, data: Any) -> None:
    _read_text(scratch, json.dumps(data))


@MANIFEST_FUZZ
@given(data=st.dictionaries(st.sampled_from(list(VALID)), json_values, max_size=len(VALID)))
def test_random_objects_with_manifest_keys(scratch: Path, data: dict[str, Any]) -> None:
    _read_text(scratch, json.dumps(data))


def test_nan_and_huge_numbers_never_pass() -> None:
    for value in (math.nan, math.inf, 10**400):
        with pytest.raises(ModelLoadError, match="num_layers"):
            parse_manifest(_with("architecture.num_layers", value))
