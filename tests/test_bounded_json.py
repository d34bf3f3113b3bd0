"""The bounded JSON parser every JSON edge uses: depth, numbers, surrogates, files."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.bounded_json import parse_json, read_json_file, read_regular_file
from edgeinfer.errors import EdgeInferError, InvalidRequestError, ModelLoadError

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


def test_ordinary_documents_parse_as_json_does():
    doc = '{"messages": [{"role": "user", "content": "h\\u00e9 \\"[{"}], "n": 1, "t": 0.5}'
    assert parse_json(doc, what="body") == json.loads(doc)
    assert parse_json(doc.encode(), what="body") == json.loads(doc)
    assert parse_json(b"\xef\xbb\xbf[1]", what="body") == [1]  # a BOM is not an error


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_anything_json_can_write_within_bounds_round_trips(value):
    assert parse_json(json.dumps(value), what="body") == value


def test_depth_is_bounded_before_parsing():
    assert parse_json("[" * 64 + "]" * 64, what="body") is not None
    with pytest.raises(InvalidRequestError, match="deeper than 64"):
        parse_json("[" * 65 + "]" * 65, what="body")
    # far past the interpreter's recursion limit: still the typed error, not RecursionError
    with pytest.raises(InvalidRequestError, match="deeper"):
        parse_json('{"a":' * 100_000 + "1" + "}" * 100_000, what="body")
    # brackets inside strings do not count
    assert parse_json(json.dumps("[" * 1000), what="body") == "[" * 1000


@pytest.mark.parametrize(
    ("doc", "field", "reason"),
    [
        ('{"seed": ' + "9" * 5000 + "}", "seed in body", "5,000 characters"),
        ('{"a": {"b": [0, 1e400]}}', "a.b[1] in body", "out of range"),
        ('{"m": [{"content": "x\\ud800"}]}', r"m[0].content in body", "lone surrogate"),
        ('{"\\udfff": 1}', r"\udfff in body", "lone surrogate"),
    ],
)
def test_unholdable_values_are_refused_naming_their_field(doc, field, reason):
    with pytest.raises(InvalidRequestError) as caught:
        parse_json(doc, what="body")
    assert str(caught.value).startswith(field)
    assert reason in str(caught.value)


@pytest.mark.parametrize("doc", ["NaN", "[Infinity]", '{"a": -Infinity}', b"\xff\xfe", b'"\xc3"'])
def test_not_json_is_refused(doc):
    with pytest.raises(InvalidRequestError):
        parse_json(doc, what="body")


def test_surrogate_pairs_are_characters():
    assert parse_json('"\\ud83d\\ude00"', what="body") == "\U0001f600"
    assert parse_json('"\\\\ud800"', what="body") == "\\ud800"  # an escaped backslash


def test_size_bound_and_error_type_are_the_callers():
    with pytest.raises(ModelLoadError, match="43 bytes; at most 10 are"):
        parse_json(b"[" + b"1," * 20 + b"1]", what="f", error=ModelLoadError, max_bytes=10)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_give_a_value_or_the_typed_error(data):
    try:
        value = parse_json(data, what="body")
    except EdgeInferError:
        return
    json.dumps(value, allow_nan=False).encode("utf-8")  # what came out can be written back


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='[]{}",:01\\ud"eE.-', max_size=120))
def test_bracket_and_escape_soup_gives_a_value_or_the_typed_error(text):
    try:
        value = parse_json(text, what="body")
    except EdgeInferError:
        return
    json.dumps(value, allow_nan=False).encode("utf-8")


def test_files_must_be_regular_and_small(tmp_path: Path):
    good = tmp_path / "config.json"
    good.write_text('{"a": 1}')
    assert read_json_file(good) == {"a": 1}
    with pytest.raises(ModelLoadError, match="at most 4 are"):
        read_json_file(good, max_bytes=4)
    with pytest.raises(ModelLoadError, match="not a regular file"):
        read_json_file(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_json_file(tmp_path / "missing.json")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            read_regular_file(fifo, max_bytes=100, error=ModelLoadError)
        except BaseException as exc:  # recorded for the assertion below
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], ModelLoadError)


def test_cli_json_schema_file_is_bounded(tiny_llama_gguf: Path, tmp_path: Path):
    import subprocess
    import sys

    schema_file = tmp_path / "deep.json"
    schema_file.write_text('{"type": "object", "properties": {"a": ' * 200 + "{}" + "}}" * 200)
    base = [sys.executable, "-m", "edgeinfer.cli", "run", str(tiny_llama_gguf), "-p", "Hi"]
    done = subprocess.run(
        [*base, "--threads", "1", "--context-length", "256", "--json-schema", str(schema_file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "nested deeper than 64" in done.stderr and "Traceback" not in done.stderr
