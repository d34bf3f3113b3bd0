"""Hostile GGUF metadata and tensor tables: whatever a file's parts claim about each other,
the loader answers ModelLoadError and the native builder ConversionError, naming the key —
never a raw Python exception, and never a file that reaches llama.cpp and aborts it.

The tiny model (tests/ggufgen.py: a consistent Llama with a byte-level BPE vocabulary, built
without torch) is taken apart and put together again with one part replaced."""

from __future__ import annotations

import importlib.util
import select
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edgeinfer.errors import ConversionError, EdgeInferError, ModelLoadError
from edgeinfer.files.gguf_checks import check_gguf_model
from edgeinfer.files.gguf_file import read_gguf_header
from edgeinfer.loader import resolve

from . import ggufgen as g

CHECKS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ENGINE_CASES = 60  # each one loads the file in llama.cpp (a subprocess) or builds its graph

Edit = Callable[[g.Model], None]


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


def _model(edit: Edit | None = None) -> g.Model:
    model = g.tiny_llama()
    if edit is not None:
        edit(model)
    return model


def _set(key: str, value: g.Value) -> Edit:
    def edit(model: g.Model) -> None:
        model.metadata[key] = value

    return edit


def _tensor(name: str, change: Callable[[g.Tensor], g.Tensor]) -> Edit:
    def edit(model: g.Model) -> None:
        model.tensors = [change(t) if t.name == name else t for t in model.tensors]

    return edit


def _drop_tokens(n: int) -> Edit:
    def edit(model: g.Model) -> None:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            element, items = model.metadata[key].value
            model.metadata[key] = g.Value(g.ARRAY, (element, items[:-n]))
        model.metadata["tokenizer.ggml.eos_token_id"] = g.Value(g.U32, 0)
        model.metadata["tokenizer.ggml.bos_token_id"] = g.Value(g.U32, 0)

    return edit


def _token(i: int, text: str | bytes) -> Edit:
    def edit(model: g.Model) -> None:
        element, items = model.metadata["tokenizer.ggml.tokens"].value
        items = list(items)
        items[i] = text
        model.metadata["tokenizer.ggml.tokens"] = g.Value(g.ARRAY, (element, items))

    return edit


def _overlap(model: g.Model) -> None:
    model.tensors[-1].offset = 0  # output_norm's bytes are token_embd's first bytes


def _builder_refuses(path: Path) -> None:
    """The builder's own entry points, as `convert` and the catalog's ONNX route call them."""
    from edgeinfer.converters.onnx.builder import gguf_shape
    from edgeinfer.converters.onnx.vocab import checked_tokenizer_json, read_gguf_vocabulary

    gguf_shape(read_gguf_header(path))
    checked_tokenizer_json(read_gguf_vocabulary(path), path.name)


_U32 = g.U32
_A = "llama.attention."


def _arr(element: int, items: list[object]) -> g.Value:
    return g.Value(g.ARRAY, (element, items))


def _shape(name: str, *dims: int) -> Edit:
    return _tensor(name, lambda t: g.reshaped(t, dims))


NAMED_CASES: list[tuple[str, Edit, str]] = [
    ("kv heads do not divide", _set(_A + "head_count_kv", g.Value(_U32, 3)), "head_count"),
    ("zero heads", _set(_A + "head_count", g.Value(_U32, 0)), "head_count"),
    ("zero kv heads", _set(_A + "head_count_kv", g.Value(_U32, 0)), "head_count_kv"),
    ("heads do not divide hidden", _set(_A + "head_count", g.Value(_U32, 6)), "head_count"),
    ("ffn a string", _set("llama.feed_forward_length", g.Value(g.STRING, "128")), "feed_forward"),
    ("ffn zero", _set("llama.feed_forward_length", g.Value(_U32, 0)), "feed_forward"),
    ("rope base a string", _set("llama.rope.freq_base", g.Value(g.STRING, "1e4")), "freq_base"),
    ("eps negative", _set(_A + "layer_norm_rms_epsilon", g.Value(g.F32, -1.0)), "eps"),
    ("eps nan", _set(_A + "layer_norm_rms_epsilon", g.Value(g.F32, float("nan"))), "eps"),
    ("rope dims odd", _set("llama.rope.dimension_count", g.Value(_U32, 15)), "dimension_count"),
    ("rope dims many", _set("llama.rope.dimension_count", g.Value(_U32, 32)), "dimension_count"),
    ("experts unused", _set("llama.expert_count", g.Value(_U32, 4)), "expert"),
    ("used > experts", _set("llama.expert_used_count", g.Value(_U32, 2)), "expert"),
    ("tokens of ints", _set("tokenizer.ggml.tokens", _arr(_U32, [1, 2])), "tokens"),
    ("tokens a string", _set("tokenizer.ggml.tokens", g.Value(g.STRING, "abc")), "tokens"),
    ("types of u8", _set("tokenizer.ggml.token_type", _arr(g.U8, [1] * 267)), "type"),
    ("types short", _set("tokenizer.ggml.token_type", _arr(g.I32, [1] * 9)), "type"),
    ("scores short", _set("tokenizer.ggml.scores", _arr(g.F32, [0.0] * 3)), "scores"),
    ("merge no space", _set("tokenizer.ggml.merges", _arr(g.STRING, ["ab"])), "merges"),
    ("merges of ints", _set("tokenizer.ggml.merges", _arr(g.I32, [1])), "merges"),
    ("model an int", _set("tokenizer.ggml.model", g.Value(_U32, 2)), "tokenizer.ggml.model"),
    ("vocab shorter than embedding", _drop_tokens(5), "rows"),
    ("q of the wrong shape", _shape("blk.0.attn_q.weight", 64, 32), "attn_q"),
    ("k of the wrong shape", _shape("blk.1.attn_k.weight", 64, 64), "attn_k"),
    ("ffn of the wrong shape", _shape("blk.0.ffn_down.weight", 64, 128), "ffn_down"),
    ("norm of the wrong shape", _shape("output_norm.weight", 32), "output_norm"),
    ("embedding 1-D", _shape("token_embd.weight", 64 * 267), "token_embd"),
    ("embedding wider", _shape("token_embd.weight", 128, 267), "token_embd"),
    ("overlapping tensors", _overlap, "overlap"),
    ("a repeated token", _token(200, "a"), r"tokens\[200\] repeats token 97"),
    ("too many layers", _set("llama.block_count", g.Value(_U32, 513)), "block_count"),
    ("zero layers", _set("llama.block_count", g.Value(_U32, 0)), "block_count"),
    ("unknown rope scaling", _set("llama.rope.scaling.type", g.Value(g.STRING, "x")), "scaling"),
    ("expert groups", _set("llama.expert_group_count", g.Value(_U32, 2)), "expert_group"),
]


def test_the_tiny_model_passes(scratch: Path) -> None:
    path = _model().write(scratch / "ok.gguf")
    source = resolve(path)
    dims = check_gguf_model(source.header)
    assert dims is not None and (dims.heads, dims.kv_heads, dims.key_dim) == (4, 2, 16)
    _builder_refuses(path)  # ... does not refuse it


@pytest.mark.parametrize("why, edit, match", NAMED_CASES, ids=[c[0] for c in NAMED_CASES])
def test_inconsistent_models_are_refused_naming_the_key(
    scratch: Path, why: str, edit: Edit, match: str
) -> None:
    path = _model(edit).write(scratch / "bad.gguf")
    with pytest.raises(ModelLoadError, match=match):
        resolve(path)
    with pytest.raises((ConversionError, ModelLoadError), match=match):
        _builder_refuses(path)


# -- generated hostile values ------------------------------------------------------------------

_SIZES = {g.U8: 1, g.I8: 1, g.U16: 2, g.I16: 2, g.U32: 4, g.I32: 4, g.F32: 4, g.BOOL: 1}
_SIZES |= {g.U64: 8, g.I64: 8, g.F64: 8}
_INTERESTING = [0, 1, 2, 3, 5, 6, 7, 15, 16, 17, 32, 63, 64, 65, 255, 256, 267, 2**31 - 1]
_INTERESTING += [2**32 - 1, 2**63 - 1]
ATTACKED_KEYS = [
    *(f"llama.{k}" for k in (
        "context_length", "embedding_length", "block_count", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "attention.value_length", "rope.dimension_count", "rope.freq_base",
        "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count",
    )),
    "general.alignment", "tokenizer.ggml.model", "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
]  # fmt: skip


@st.composite
def scalar(draw: st.DrawFn) -> g.Value:
    vtype = draw(st.sampled_from(sorted(_SIZES)))
    size = _SIZES[vtype]
    if vtype in (g.F32, g.F64):
        width = 32 if size == 4 else 64
        number = draw(st.one_of(st.sampled_from([0.0, -1.0, 1e-5, 1e30]), st.floats(width=width)))
        return g.Value(vtype, raw=struct.pack("<f" if size == 4 else "<d", number))
    number = draw(st.sampled_from(_INTERESTING)) % (1 << (8 * size))
    raw = number.to_bytes(size, "little")
    return g.Value(
        vtype, raw=draw(st.one_of(st.just(raw), st.binary(min_size=size, max_size=size)))
    )


text_payloads = st.one_of(
    st.sampled_from([b"64", b"gpt2", b"llama", b"default", b"", b"a b", b"\xff\xfe", b"\xc3("]),
    st.binary(max_size=12),
)


@st.composite
def array(draw: st.DrawFn) -> g.Value:
    element = draw(st.sampled_from([*sorted(_SIZES), g.STRING]))
    n = draw(st.sampled_from([0, 1, 9, 266, 267, 268]))
    if element == g.STRING:
        item = draw(text_payloads)
        return g.Value(g.ARRAY, raw=struct.pack("<IQ", element, n) + g._string(item) * n)
    payload = draw(st.binary(min_size=_SIZES[element], max_size=_SIZES[element]))
    return g.Value(g.ARRAY, raw=struct.pack("<IQ", element, n) + payload * n)


hostile_values = st.one_of(
    scalar(), array(), text_payloads.map(lambda raw: g.Value(g.STRING, raw=g._string(raw)))
)


@st.composite
def hostile_models(draw: st.DrawFn) -> g.Model:
    model = g.tiny_llama()
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(ATTACKED_KEYS))
        if draw(st.integers(0, 9)) == 0:
            model.metadata.pop(key, None)
        else:
            model.metadata[key] = draw(hostile_values)
    return model


_NUMERIC_KEYS = [k for k in ATTACKED_KEYS if k.startswith("llama.") and "freq" not in k]
_NUMERIC_KEYS = [k for k in _NUMERIC_KEYS if "epsilon" not in k]


@st.composite
def plausible_models(draw: st.DrawFn) -> g.Model:
    """Well-typed numbers that disagree: what passes a type check and reaches the relations
    (heads that do not divide, layers past llama.cpp's limit, experts without routing)."""
    model = g.tiny_llama()
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(_NUMERIC_KEYS))
        model.metadata[key] = g.Value(g.U32, draw(st.sampled_from(_INTERESTING[:-2])))
    return model


@st.composite
def hostile_tables(draw: st.DrawFn) -> g.Model:
    """Tensor shapes that disagree with the metadata (data sized to match, so the file is
    complete), renamed or overlapping tensors."""
    model = g.tiny_llama()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(model.tensors) - 1))
        t = model.tensors[i]
        kind = draw(st.sampled_from(["shape", "swap", "rename", "overlap", "drop"]))
        if kind == "shape":
            dims = draw(
                st.lists(st.sampled_from([1, 2, 16, 32, 63, 64, 128, 267]), min_size=1, max_size=3)
            )
            model.tensors[i] = g.reshaped(t, dims)
        elif kind == "swap" and len(t.shape) == 2:
            model.tensors[i] = g.reshaped(t, tuple(reversed(t.shape)))
        elif kind == "rename":
            other = draw(st.sampled_from(model.tensors)).name
            model.tensors[i] = g.Tensor(other + ".x", t.shape, t.data)
        elif kind == "overlap" and i:
            t.offset = 0
        elif kind == "drop":
            del model.tensors[i]
    return model


def _refused_or_fine(path: Path) -> bool:
    """True when both the loader and the builder accept ``path``; False when refused with
    the error each raises on purpose. Any other exception fails the test."""
    try:
        resolve(path)
    except ModelLoadError:
        loader_ok = False
    else:
        loader_ok = True
    try:
        _builder_refuses(path)
    except (ConversionError, ModelLoadError):
        return False
    return loader_ok


@CHECKS
@given(model=hostile_models())
def test_hostile_metadata_is_refused_or_consistent(scratch: Path, model: g.Model) -> None:
    _refused_or_fine(model.write(scratch / "meta.gguf"))


@CHECKS
@given(model=hostile_tables())
def test_hostile_tensor_tables_are_refused_or_consistent(scratch: Path, model: g.Model) -> None:
    _refused_or_fine(model.write(scratch / "table.gguf"))


# -- the engines themselves: what passes the checks must not crash them -------------------------

_WORKER = """
import sys, edgeinfer
for line in sys.stdin:
    try:
        with edgeinfer.load(line.strip(), device="cpu", context_length=64, threads=1) as m:
            m.generate("the then", max_new_tokens=2, temperature=0)
        print("@@ ok", flush=True)
    except edgeinfer.EdgeInferError:
        print("@@ refused", flush=True)
    except Exception as exc:
        print("@@ untyped", type(exc).__name__, str(exc)[:200].replace("\\n", " "), flush=True)
"""


class _Engine:
    """One Python process loading files in llama.cpp, restarted after a crash. Its stdout is
    read unbuffered, so select() never misses a line already read into a buffer."""

    def __init__(self) -> None:
        # started here, by the module's fixture, so it is the fixture's child (the leak check
        # blames a test for a child it starts); a restart after a crash comes in a test that
        # has failed already
        self.proc: subprocess.Popen[bytes] | None = self._start()

    @staticmethod
    def _start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )

    def ask(self, path: Path) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{path}\n".encode())
        # the engine may write to stdout itself: the answer is the next line marked "@@ "
        deadline = time.monotonic() + 120
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                break
            line = self.proc.stdout.readline()
            if not line:
                return f"crashed with {self.proc.wait(timeout=30)}"
            if line.startswith(b"@@ "):
                return line[3:].decode(errors="replace").strip()
        self.close()
        return "hung"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def engine() -> Iterator[_Engine]:
    pytest.importorskip("llama_cpp")
    worker = _Engine()
    yield worker
    worker.close()


def test_the_engine_worker_runs_the_tiny_model(scratch: Path, engine: _Engine) -> None:
    assert engine.ask(_model().write(scratch / "engine-ok.gguf")) == "ok"


@settings(CHECKS, max_examples=ENGINE_CASES)
@given(model=st.one_of(plausible_models(), hostile_models(), hostile_tables()))
def test_llama_cpp_never_crashes_on_hostile_models(
    scratch: Path, engine: _Engine, model: g.Model
) -> None:
    path = model.write(scratch / "engine.gguf")
    try:
        resolve(path)
        event("passed edgeinfer's checks: reached llama.cpp")
    except ModelLoadError:
        event("refused by edgeinfer's checks")
    answer = engine.ask(path)
    event(f"llama.cpp worker: {answer}")
    assert answer in ("ok", "refused"), answer


@settings(CHECKS, max_examples=ENGINE_CASES)
@given(model=st.one_of(hostile_models(), hostile_tables()))
def test_the_builder_writes_or_refuses_hostile_models(scratch: Path, model: g.Model) -> None:
    pytest.importorskip("onnx")
    from edgeinfer.converters.onnx.folder import write_gguf_folder

    path = model.write(scratch / "build.gguf")
    with tempfile.TemporaryDirectory(dir=scratch) as out:
        try:
            write_gguf_folder(path, Path(out), max_context=64)
            event("built")
        except EdgeInferError:
            event("refused")


# -- the real commands ---------------------------------------------------------------------------

CLI = [sys.executable, "-m", "edgeinfer.cli"]
CLI_CASES = [c for c in NAMED_CASES if c[0] in (
    "kv heads do not divide", "zero kv heads", "heads do not divide hidden", "tokens of ints",
    "types of u8", "experts unused", "q of the wrong shape",
)]  # fmt: skip


def _command(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=300, start_new_session=True
    )


def test_the_commands_run_and_convert_the_tiny_model(scratch: Path) -> None:
    """The control: without the damage, the same commands succeed."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("onnx")
    path = _model().write(scratch / "cli-ok.gguf")
    assert _command(["run", str(path), "-p", "the", "-n", "2"]).returncode == 0
    out = _command(["convert", str(path), "-o", str(scratch / "cli-ok-onnx"), "--to", "onnx"])
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("why, edit, match", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_the_commands_answer_hostile_files_with_one_line(
    scratch: Path, why: str, edit: Edit, match: str
) -> None:
    """``edgeinfer run`` (llama.cpp) and ``edgeinfer convert`` (the native builder, and
    llama.cpp's quantizer) exit 1 with one line naming the key: not -6 (SIGABRT in ggml)."""
    pytest.importorskip("llama_cpp")
    path = _model(edit).write(scratch / "cli-bad.gguf")
    commands = [
        ["run", str(path), "-p", "hi", "-n", "2"],
        ["convert", str(path), "-o", str(scratch / "cli-bad-onnx"), "--to", "onnx"],
        ["convert", str(path), "-o", str(scratch / "cli-bad-q8.gguf"), "--quant", "q8_0"],
    ]
    for args in commands:
        out = _command(args)
        assert out.returncode == 1, (args, out.returncode, out.stderr[-2000:])
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert match in lines[0]
    assert not (scratch / "cli-bad-onnx").exists()


def test_a_token_that_is_not_utf8_loads_in_llama_cpp_and_is_refused_by_the_builder(
    scratch: Path,
) -> None:
    """llama.cpp reads such a token as U+FFFD (no crash); tokenizer.json can hold only text,
    so the builder refuses it by index instead of writing a vocabulary that disagrees."""
    path = _model(_token(200, b"\xff\xfe")).write(scratch / "not-utf8.gguf")
    assert resolve(path).header.token_facts is not None
    with pytest.raises(ConversionError, match=r"tokens\[200\] is not UTF-8"):
        _builder_refuses(path)
    if importlib.util.find_spec("llama_cpp") is not None:
        import edgeinfer

        with edgeinfer.load(path, device="cpu", context_length=64, threads=1) as model:
            model.generate("the then", max_new_tokens=2, temperature=0)
