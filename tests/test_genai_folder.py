"""Folders in onnxruntime-genai's layout (genai_config.json + model.onnx + tokenizer) load
through edgeinfer's ONNX backend, with its memory plan and generator."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.errors import ModelLoadError
from edgeinfer.files.genai_folder import manifest_from_genai_folder
from edgeinfer.files.gguf_file import read_gguf_header
from edgeinfer.files.manifest import Manifest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


def _genai_config(gguf: Path, *, share: bool = True) -> dict[str, object]:
    """genai_config.json as onnxruntime-genai's builder writes it (the keys it writes)."""
    meta = read_gguf_header(gguf).metadata
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    return {
        "model": {
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", 1),
            "context_length": meta[f"{arch}.context_length"],
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": hidden // heads,
                "hidden_size": hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": heads,
                "num_hidden_layers": meta[f"{arch}.block_count"],
                "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
            },
            "eos_token_id": [meta.get("tokenizer.ggml.eos_token_id", 2)],
            "type": arch,
            "vocab_size": len(meta["tokenizer.ggml.tokens"])
            if isinstance(meta["tokenizer.ggml.tokens"], list)
            else meta["tokenizer.ggml.tokens"].length,
        },
        "search": {"past_present_share_buffer": share, "max_length": 256},
    }


@pytest.fixture
def genai_folder(tiny_llama_gguf: Path, tmp_path: Path) -> Path:
    """A GroupQueryAttention graph with the tensor names genai graphs use, in genai's folder
    layout: no edgeinfer.json."""
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    built = tmp_path / "built"
    built.mkdir()
    write_gguf_folder(tiny_llama_gguf, built, max_context=256)
    folder = tmp_path / "genai"
    folder.mkdir()
    for name in ("model.onnx", "model.onnx.data", "tokenizer.json"):
        shutil.copy2(built / name, folder / name)
    config = _genai_config(tiny_llama_gguf)
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


def test_genai_folder_loads_and_generates_like_the_same_graph(
    genai_folder: Path, tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    ours = tmp_path / "ours"
    ours.mkdir()
    write_gguf_folder(tiny_llama_gguf, ours, max_context=256)
    with edgeinfer.load(genai_folder, context_length=128, threads=1) as model:
        assert model.info["quantization"] == "onnxruntime-genai"
        assert model.info["memory_plan"]["kv_factor"] == 1.0  # one shared cache buffer
        got = model.generate("Hello there", max_new_tokens=8, temperature=0)
    with edgeinfer.load(ours, context_length=128, threads=1) as model:
        want = model.generate("Hello there", max_new_tokens=8, temperature=0)
    assert got.token_ids == want.token_ids
    assert not (genai_folder / "edgeinfer.json").exists()  # nothing written into the folder


def test_genai_folder_with_other_tensor_names_is_refused(genai_folder: Path) -> None:
    config = json.loads((genai_folder / "genai_config.json").read_text())
    config["model"]["decoder"]["inputs"]["past_key_names"] = "past.%d.k"
    (genai_folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"past_key_names='past.%d.k'.*'past_key_values"):
        edgeinfer.load(genai_folder)


def test_damaged_genai_config_is_a_load_error(genai_folder: Path) -> None:
    (genai_folder / "genai_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"genai_config\.json"):
        edgeinfer.load(genai_folder)
    (genai_folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": []}}))
    with pytest.raises(ModelLoadError, match=r"model\.decoder must be a JSON object"):
        edgeinfer.load(genai_folder)


# -- a folder from a stranger: paths, symlinks, FIFOs, bounds, the rotary cache ---------------

# genai_config.json of tests/ggufgen.py's tiny Llama, as onnxruntime-genai's builder writes it
TINY_CONFIG: dict[str, Any] = {
    "model": {
        "bos_token_id": 266,
        "context_length": 256,
        "decoder": {
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
            "filename": "model.onnx",
            "head_size": 16,
            "hidden_size": 64,
            "inputs": {
                "input_ids": "input_ids",
                "attention_mask": "attention_mask",
                "past_key_names": "past_key_values.%d.key",
                "past_value_names": "past_key_values.%d.value",
            },
            "outputs": {
                "logits": "logits",
                "present_key_names": "present.%d.key",
                "present_value_names": "present.%d.value",
            },
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
        },
        "eos_token_id": [266],
        "type": "llama",
        "vocab_size": 267,
    },
    "search": {"past_present_share_buffer": True, "max_length": 256},
}
_OPENED: list[str] | None = None  # paths opened while a check runs (None: not recording)


def _record_opens(event: str, args: tuple[object, ...]) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_record_opens)  # audit hooks cannot be removed: it records only when asked


def _hung(signum: int, frame: object) -> None:
    raise TimeoutError("the check hung (a FIFO opened for reading blocks until a writer comes)")


def _opened_during(call: Callable[[], object]) -> tuple[object, list[str]]:
    """``call()``'s result (or the ModelLoadError it raised) and every path it opened; a call
    that blocks for 20 s fails instead of hanging the suite."""
    global _OPENED
    _OPENED = []
    previous = signal.signal(signal.SIGALRM, _hung)
    suite_left, _ = signal.setitimer(signal.ITIMER_REAL, 20.0)  # the suite's timeout, if any
    started = time.monotonic()
    try:
        try:
            result: object = call()
        except ModelLoadError as exc:
            result = exc
        return result, [os.path.realpath(p) for p in _OPENED]  # symlinks and ".." resolved
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if suite_left > 0:  # the suite's timer goes on with what it had left
            left = suite_left - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
        _OPENED = None


@pytest.fixture(scope="module")
def genai_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genai folder of the torch-free tiny Llama (tests/ggufgen.py), copied per test."""
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    from .ggufgen import tiny_llama

    root = tmp_path_factory.mktemp("genai-base")
    gguf = tiny_llama(context=256).write(root / "tiny.gguf")
    built = root / "built"
    built.mkdir()
    write_gguf_folder(gguf, built, max_context=256)
    folder = root / "genai"
    folder.mkdir()
    for name in ("model.onnx", "model.onnx.data", "tokenizer.json"):
        shutil.copy2(built / name, folder / name)
    assert _genai_config(gguf) == TINY_CONFIG
    (folder / "genai_config.json").write_text(json.dumps(TINY_CONFIG))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def _stranger(base: Path, root: Path) -> tuple[Path, Path]:
    """A copy of ``base`` in ``root/folder`` with traps in and around it: ``root/outside``
    holds a valid graph and a FIFO; the folder links to them, holds a FIFO and a subfolder."""
    folder, outside = root / "folder", root / "outside"
    shutil.copytree(base, folder, symlinks=True)
    outside.mkdir()
    shutil.copy2(base / "model.onnx", outside / "secret-graph.onnx")
    (outside / "secret.json").write_text('{"bos_token": "SECRET"}')
    os.mkfifo(outside / "pipe")
    os.symlink(outside / "secret-graph.onnx", folder / "link.onnx")
    os.symlink(outside, folder / "uplink")
    os.mkfifo(folder / "fifo.onnx")
    (folder / "sub").mkdir()
    return folder, outside


def _edit_config(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((folder / "genai_config.json").read_text())
    edit(config)
    (folder / "genai_config.json").write_text(json.dumps(config))


def _set_filename(name: object) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        config["model"]["decoder"]["filename"] = name

    return edit


OUTSIDE_FILENAMES = [
    "../outside/secret-graph.onnx",
    "sub/../../outside/secret-graph.onnx",
    "link.onnx",
    "uplink/secret-graph.onnx",
    "uplink/pipe",
]


@pytest.mark.parametrize("name", OUTSIDE_FILENAMES)
def test_a_graph_outside_the_folder_is_never_opened(
    genai_base: Path, tmp_path: Path, name: str
) -> None:
    folder, outside = _stranger(genai_base, tmp_path)
    _edit_config(folder, _set_filename(name))
    result, opened = _opened_during(lambda: manifest_from_genai_folder(folder))
    assert isinstance(result, ModelLoadError), result
    assert "model.decoder.filename" in str(result)
    assert "secret-graph" not in str(result).replace(name, "")  # only the name it was given
    assert not [p for p in opened if str(outside.resolve()) in p or "secret" in p], opened


def test_an_absolute_graph_path_is_refused(genai_base: Path, tmp_path: Path) -> None:
    folder, outside = _stranger(genai_base, tmp_path)
    _edit_config(folder, _set_filename(str(outside / "secret-graph.onnx")))
    result, opened = _opened_during(lambda: manifest_from_genai_folder(folder))
    assert isinstance(result, ModelLoadError) and "absolute" in str(result)
    assert not [p for p in opened if str(outside.resolve()) in p], opened


@pytest.mark.parametrize("name", ["genai_config.json", "tokenizer_config.json"])
def test_config_files_linked_from_outside_are_refused(
    genai_base: Path, tmp_path: Path, name: str
) -> None:
    folder, outside = _stranger(genai_base, tmp_path)
    real = outside / name
    shutil.move(folder / name, real)
    os.symlink(real, folder / name)
    result, opened = _opened_during(lambda: manifest_from_genai_folder(folder))
    assert isinstance(result, ModelLoadError) and name in str(result)
    assert not [p for p in opened if str(outside.resolve()) in p], opened


@pytest.mark.parametrize(
    "content, match",
    [
        (b"[" * 100 + b"]" * 100, "nested"),
        (b'{"model": {"context_length": 1' + b"0" * 5000 + b"}}", "context_length"),
        (b'{"model": {"type": "\\ud800"}}', "surrogate"),
        (b'{"model": {"context_length": 1e999}}', "context_length"),
        (b" " * (17 << 20), "bytes"),
        (b"\xff\xfe{}", "UTF-8"),
    ],
    ids=["deep", "long number", "lone surrogate", "out of range", "huge", "not UTF-8"],
)
def test_hostile_genai_config_json_is_refused_by_field(
    genai_base: Path, tmp_path: Path, content: bytes, match: str
) -> None:
    folder, _ = _stranger(genai_base, tmp_path)
    (folder / "genai_config.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match=match):
        manifest_from_genai_folder(folder)
    (folder / "genai_config.json").unlink()
    (folder / "genai_config.json").write_text(json.dumps(TINY_CONFIG))
    (folder / "tokenizer_config.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match=match):
        manifest_from_genai_folder(folder)


def test_a_context_longer_than_the_rotary_cache_is_refused_at_load(
    genai_base: Path, tmp_path: Path
) -> None:
    folder, _ = _stranger(genai_base, tmp_path)
    _edit_config(folder, lambda c: c["model"].update(context_length=257))
    with pytest.raises(ModelLoadError, match=r"model\.context_length=257.*256 positions"):
        edgeinfer.load(folder, device="cpu")
    _edit_config(folder, lambda c: c["model"].update(context_length=256))
    with edgeinfer.load(folder, device="cpu", context_length=256, threads=1) as model:
        assert model.info["context_length"] == 256


def test_a_native_manifest_longer_than_the_rotary_cache_is_refused(
    genai_base: Path, tmp_path: Path
) -> None:
    """The same check guards edgeinfer.json: the backend reads the graph's cache too."""
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    from .ggufgen import tiny_llama

    gguf = tiny_llama(context=256).write(tmp_path / "tiny.gguf")
    folder = tmp_path / "native"
    folder.mkdir()
    write_gguf_folder(gguf, folder, max_context=128)
    manifest = json.loads((folder / "edgeinfer.json").read_text())
    manifest["architecture"]["max_context"] = 4096
    (folder / "edgeinfer.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=r"max_context=4096.*128 positions"):
        edgeinfer.load(folder, device="cpu", context_length=64)


_CLI = [sys.executable, "-m", "edgeinfer.cli"]


@pytest.mark.parametrize(
    "fifo", ["model.onnx", "genai_config.json", "tokenizer_config.json", "tokenizer.json"]
)
def test_a_fifo_in_a_genai_folder_errors_out_instead_of_hanging(
    genai_base: Path, tmp_path: Path, fifo: str
) -> None:
    folder, _ = _stranger(genai_base, tmp_path)
    (folder / fifo).unlink()
    os.mkfifo(folder / fifo)
    start = time.monotonic()
    out = subprocess.run(
        [*_CLI, "run", str(folder), "-p", "hi", "-n", "2"],
        capture_output=True,
        text=True,
        timeout=120,  # a hang fails here; the error itself comes in seconds
        start_new_session=True,
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert fifo in out.stderr or "regular file" in out.stderr
    assert time.monotonic() - start < 60


# -- generated folders ----------------------------------------------------------------------

hostile_names = st.one_of(
    st.sampled_from(
        [
            "model.onnx",
            *OUTSIDE_FILENAMES,
            "fifo.onnx",
            "sub",
            "",
            " ",
            "a\0b",
            "C:\\x.onnx",
            "..\\outside\\secret-graph.onnx",
            "/etc/passwd",
            "./model.onnx",
            "sub/../model.onnx",
        ]
    ),
    st.text(max_size=16),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=4), max_size=2),
)
json_junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text()),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def hostile_folders(draw: st.DrawFn) -> tuple[dict[str, Any], bytes | None, str | None]:
    """(genai_config.json, tokenizer_config.json's bytes or None to remove it, a trap that
    replaces tokenizer_config.json: "fifo", "link" or None)."""
    config = json.loads(json.dumps(TINY_CONFIG))
    config["model"]["decoder"]["filename"] = draw(hostile_names)
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.sampled_from([config, config["model"], config["model"]["decoder"]]))
        key = draw(
            st.sampled_from(
                ["context_length", "vocab_size", "eos_token_id", "num_hidden_layers", "head_size",
                 "hidden_size", "inputs", "search", "type", "num_key_value_heads"]
            )
        )  # fmt: skip
        where[key] = draw(st.one_of(json_junk, st.integers(-(2**70), 2**70)))
    depth = draw(st.sampled_from([0, 0, 10, 63, 65, 200]))
    if depth:
        config["model"]["junk"] = json.loads("[" * depth + "]" * depth)
    tok = draw(
        st.one_of(
            st.none(),
            st.just(b'{"eos_token": "<|endoftext|>"}'),
            json_junk.map(lambda v: json.dumps(v).encode()),
            st.binary(max_size=16),
        )
    )
    trap = draw(st.sampled_from([None, None, "fifo", "link"]))
    return config, tok, trap


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=hostile_folders())
def test_generated_genai_folders_are_refused_or_stay_inside(
    genai_base: Path, tmp_path_factory: pytest.TempPathFactory, case: tuple[Any, Any, Any]
) -> None:
    config, tok, trap = case
    folder, outside = _stranger(genai_base, tmp_path_factory.mktemp("gen"))
    (folder / "genai_config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").unlink()
    if trap == "fifo":
        os.mkfifo(folder / "tokenizer_config.json")
    elif trap == "link":
        os.symlink(outside / "secret.json", folder / "tokenizer_config.json")
    elif tok is not None:
        (folder / "tokenizer_config.json").write_bytes(tok)
    result, opened = _opened_during(lambda: manifest_from_genai_folder(folder))
    assert not [p for p in opened if str(outside.resolve()) in p], opened
    if not isinstance(result, ModelLoadError):
        assert isinstance(result, Manifest)
        assert (folder / result.model_file).resolve().is_relative_to(folder.resolve())
        assert "SECRET" not in repr(result)


# -- a folder made by onnxruntime-genai's own builder -------------------------------------------

BUILT = Path(__file__).resolve().parent / "data" / "genai-tiny"  # tests/make_genai_tiny.py


def _genai_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + n)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    out: list[int] = []
    while not generator.is_done() and len(out) < n:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out


def test_a_builder_made_folder_answers_as_onnxruntime_genai_does() -> None:
    """The builder's own graph and genai_config.json (not ours): edgeinfer's greedy ids equal
    onnxruntime-genai's on the same folder, computed in this run."""
    made = json.loads((BUILT.parent / "genai-tiny.json").read_text())
    assert made["builder"].startswith("python -m onnxruntime_genai.models.builder")
    manifest = manifest_from_genai_folder(BUILT)
    assert manifest is not None
    with edgeinfer.load(BUILT, context_length=128, threads=1) as model:
        ids = model.tokenize("The capital of France is")
        ours = model.generate(ids, max_new_tokens=12, temperature=0)
    assert ours.finish_reason == "length"
    assert list(ours.token_ids) == _genai_greedy(BUILT, ids, 12)


def test_the_bench_worker_for_onnxruntime_genai_runs_on_a_builder_made_folder() -> None:
    pytest.importorskip("onnxruntime_genai")
    with edgeinfer.load(BUILT, context_length=128, threads=1) as model:
        ids = model.tokenize("Hello world")
    spec = {"engine": "onnxruntime-genai", "model": str(BUILT), "prompt_ids": ids,
            "new_tokens": 8, "threads": 1, "device": "cpu", "ban_ids": []}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.bench.worker"],
        input=json.dumps(spec), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    mark = "edgeinfer-bench-result "
    (record,) = [json.loads(x[len(mark) :]) for x in done.stdout.splitlines() if x.startswith(mark)]
    assert "error" not in record, record
    assert record["tokens"] == 8 and record["provider"] == "onnxruntime-genai:cpu"
    assert record["decode_tok_s"] > 0 and record["ttft_s"] > 0
