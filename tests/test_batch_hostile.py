"""A batch job's input lines come from strangers: any bytes, any JSON, any depth and size.
The row parser never raises and gives every line a request or an error; the output file,
whatever a crash left in it, is cut back to whole records or refused; the real process
survives a hostile file and writes one record per line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.batch.files import read_rows
from edgeinfer.batch.output import recover
from edgeinfer.batch.records import (
    MAX_LINE_BYTES,
    Request,
    Row,
    encode_record,
    error_record,
    parse_line,
    parse_object,
)
from edgeinfer.errors import InvalidRequestError
from edgeinfer.generation.sampling import SamplingConfig
from edgeinfer.generation.speculative import parse_speculative

BASE = SamplingConfig()
FIXTURE = [HealthCheck.function_scoped_fixture]
FIELDS = [
    "id",
    "prompt",
    "messages",
    "max_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logit_bias",
    "response_format",
    "speculative",
    "metadata",
    "other",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
rows = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)


def check_row(row: Row) -> None:
    assert isinstance(row.id, (str, int)) and not isinstance(row.id, bool)
    if row.error is None:
        req = row.request
        assert isinstance(req, Request) and (req.prompt is None) != (req.messages is None)
    else:
        assert set(row.error) == {"type", "message"}
        line = encode_record(error_record(row.id, row.error["type"], row.error["message"]))
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        json.loads(line)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_make_a_row(raw: bytes) -> None:
    check_row(parse_line(raw, 1, BASE))


@settings(max_examples=400, deadline=None)
@given(rows)
def test_any_object_makes_a_row(obj: dict) -> None:
    row = parse_object(obj, 3, BASE)
    check_row(row)
    check_row(parse_line(json.dumps(obj).encode(), 3, BASE))


SETTINGS = st.sampled_from(
    ["off", "auto", "lookup", "lookup:4", "lookup:0", "lookup:17", "draft:m", "draft:m:2",
     "draft:", "sometimes", "", "x" * 10_240]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(SETTINGS | values)
def test_any_speculative_value_is_the_rows_setting_or_its_error(value: object) -> None:
    """A row's ``speculative`` is read by the one parser the server and load() use: what it
    takes is the row's setting (null: the job's), what it refuses is that row's error."""
    row = parse_object({"id": "s", "prompt": "x", "speculative": value}, 1, BASE)
    check_row(row)
    try:
        expected = None if value is None else parse_speculative(value)
    except InvalidRequestError as exc:
        assert row.error == {"type": "InvalidRequestError", "message": str(exc)}
        assert len(row.error["message"]) < 1000 and row.id == "s"
        return
    assert row.error is None and row.request is not None
    assert row.request.config.speculative == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=3000), st.sampled_from(["[", '{"a":']))
def test_deep_nesting_is_an_error_row(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    raw = ('{"prompt": "x", "metadata": ' + opener * depth + "1" + closer * depth + "}").encode()
    row = parse_line(raw, 1, BASE)
    check_row(row)
    assert (row.error is None) == (depth < 32)  # the row object is one level


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40), st.sampled_from(["utf-8", "utf-16", "latin-1", "cp1252"]))
def test_any_encoding_makes_a_row(text: str, encoding: str) -> None:
    raw = json.dumps({"id": "e", "prompt": text or "x"}, ensure_ascii=False)
    check_row(parse_line(raw.encode(encoding, "replace"), 1, BASE))


def test_a_line_past_the_bound_is_refused_unread(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    long = json.dumps({"id": "big", "prompt": "x" * (MAX_LINE_BYTES + 10)})
    src.write_text(long + "\n" + json.dumps({"id": "after", "prompt": "y"}) + "\n")
    got = list(read_rows(src, BASE))
    assert [r.id for r in got] == [1, "after"]
    assert "longer than" in got[0].error["message"] and got[1].error is None


def test_lone_surrogates_and_huge_numbers_are_error_rows() -> None:
    for raw in (
        b'{"id": "\\ud800", "prompt": "x"}',
        b'{"id": 1, "prompt": "\\udfff"}',
        b'{"id": ' + b"9" * 5000 + b', "prompt": "x"}',
        b'{"id": 1, "prompt": "x", "seed": 1e999}',
        b'{"id": 1, "prompt": "x", "temperature": NaN}',
    ):
        row = parse_line(raw, 1, BASE)
        check_row(row)
        assert row.error is not None


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.sampled_from(["a", 1, "b"]), max_size=4), st.binary(max_size=60))
def test_recover_keeps_whole_records_or_refuses(
    tmp_path: Path, ids: list[object], tail: bytes
) -> None:
    out = tmp_path / "out.jsonl"
    good = b"".join(encode_record(error_record(i, "X", "m")) for i in ids)  # type: ignore[arg-type]
    out.write_bytes(good + tail)
    try:
        done = recover(out)
    except InvalidRequestError as exc:
        assert "not a record of edgeinfer batch" in str(exc)
        assert out.read_bytes() == good + tail  # refused: untouched
        return
    kept = out.read_bytes()
    assert kept.startswith(good) and (kept == b"" or kept.endswith(b"\n"))
    assert sum(done.values()) == kept.count(b"\n")


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.lists(st.text(max_size=12), min_size=1, max_size=5), max_size=6))
def test_any_csv_makes_rows(tmp_path: Path, table: list[list[str]]) -> None:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        ["id", "prompt", "temperature", "stop", "messages"][: max(map(len, table), default=1)]
    )
    writer.writerows(table)
    src = tmp_path / "in.csv"
    src.write_bytes(buf.getvalue().encode("utf-8", "surrogatepass") + b"\xff\xfe,\n")
    for row in read_rows(src, BASE):
        check_row(row)


def test_the_real_process_survives_a_hostile_file(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    lines = [
        b'{"id": "ok", "prompt": "fox", "max_tokens": 2, "temperature": 0}',
        b"\xff\xfe not utf-8 \x00",
        b"[" * 100000,
        b'{"prompt": "' + b"a" * (MAX_LINE_BYTES + 1) + b'"}',
        b'{"id": "deep", "prompt": "x", "response_format": ' + b"[" * 40 + b"]" * 40 + b"}",
        b'{"id": "rf", "prompt": "x", "response_format": {"type": "json_schema", "json_schema":'
        b' {"schema": {"type": "string", "pattern": "(a+)+$"}}}, "max_tokens": 8}',
        b'{"id": "regex", "prompt": "x", "response_format": {"type": "regex", "pattern": "("}}',
        b'{"id": "bias", "prompt": "x", "logit_bias": {"99999999": 5}}',
        b'{"id": "msg", "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
        b"null",
        b'"just a string"',
        b'{"id": "ok2", "prompt": "dog", "max_tokens": 2, "temperature": 0}',
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines))  # and no newline at the end
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeinfer",
            "batch",
            str(tiny_llama_gguf),
            str(src),
            "-o",
            str(out),
        ],
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    got = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert len(got) == len(lines)
    assert got[0]["error"] is None and got[-1]["error"] is None
    assert all(r["error"] is not None for i, r in enumerate(got[1:-1], 1) if i != 5)


@pytest.mark.parametrize("kind", ["fifo", "folder", "missing"])
def test_an_input_that_is_not_a_file_is_one_line(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "in.jsonl"
    if kind == "fifo":
        os.mkfifo(src)
    elif kind == "folder":
        src.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeinfer",
            "batch",
            "no-such-model",
            str(src),
            "-o",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "not a file" in done.stderr
