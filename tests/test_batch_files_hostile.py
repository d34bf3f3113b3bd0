"""A batch job's input as strangers write it: CSV ids that look like numbers, a byte-order
mark, other encodings, JSON columns that are not JSON. Every row of the file gives exactly
one row (so one record), a CSV id is the text in the file, and a row that cannot run keeps
its own id; the real process writes one record per row with those ids."""

from __future__ import annotations

import codecs
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.batch.files import read_rows
from edgeinfer.batch.records import MAX_ID_CHARS, Row
from edgeinfer.errors import InvalidRequestError
from edgeinfer.generation.sampling import SamplingConfig

BASE = SamplingConfig()
_FIXTURE = [HealthCheck.function_scoped_fixture]

# ids a spreadsheet makes: numbers with zeros in front, signs, long digit runs, text
ids = st.one_of(
    st.from_regex(r"-?0{0,3}[0-9]{1,25}", fullmatch=True),
    st.sampled_from(["007", "00", "-0", "0", "1e3", "1.0", " 7", "7 ", "+7", "٣"]),
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12),
)
# messages cells: valid JSON, broken JSON, deep JSON, nothing
messages = st.one_of(
    st.just(""),
    st.just('[{"role": "user", "content": "hi"}]'),
    st.sampled_from(['[{"role"', "{", "[1,", "nul", '"x', "[" * 200, "[]", '{"a": 1}']),
    st.text(max_size=20),
)
prompts = st.one_of(st.just(""), st.text(min_size=1, max_size=10))


def csv_text(table: list[tuple[str, str, str]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["id", "prompt", "messages"])
    writer.writerows(table)
    return buf.getvalue()


def write_csv(path: Path, table: list[tuple[str, str, str]], encoding: str) -> Path:
    text = csv_text(table)
    data = codecs.BOM_UTF8 + text.encode() if encoding == "utf-8-bom" else text.encode(encoding)
    path.write_bytes(data)
    return path


def check_one_row_each(rows: list[Row], table: list[tuple[str, str, str]]) -> None:
    """One row per CSV record, in order, each with the id cell's text when it is one."""
    assert len(rows) == len(table)
    for row, (row_id, _, _) in zip(rows, table, strict=True):
        if 0 < len(row_id) <= MAX_ID_CHARS:
            assert row.id == row_id  # the text, never a number made of it
        else:
            assert isinstance(row.id, int) and row.id == row.line  # no id: its line
        assert (row.request is None) != (row.error is None)


@settings(max_examples=150, deadline=None, suppress_health_check=_FIXTURE)
@given(
    st.lists(st.tuples(ids, prompts, messages), max_size=8),
    st.sampled_from(["utf-8", "utf-8-bom", "utf-16"]),
)
def test_every_csv_row_gives_one_row_with_its_id_as_text(
    tmp_path: Path, table: list[tuple[str, str, str]], encoding: str
) -> None:
    table = [(i.replace("\r", ""), p.replace("\r", ""), m.replace("\r", "")) for i, p, m in table]
    got = list(read_rows(write_csv(tmp_path / "in.csv", table, encoding), BASE))
    check_one_row_each(got, table)
    same = list(read_rows(write_csv(tmp_path / "utf8.csv", table, "utf-8"), BASE))
    assert [(r.id, r.request, r.error) for r in got] == [(r.id, r.request, r.error) for r in same]


@settings(max_examples=80, deadline=None, suppress_health_check=_FIXTURE)
@given(st.lists(st.tuples(ids, prompts, messages), min_size=1, max_size=6))
def test_a_csv_in_another_single_byte_encoding_spoils_only_its_own_rows(
    tmp_path: Path, table: list[tuple[str, str, str]]
) -> None:
    table = [(i.replace("\r", ""), p.replace("\r", ""), m.replace("\r", "")) for i, p, m in table]
    src = tmp_path / "in.csv"
    src.write_bytes(csv_text(table).encode("cp1252", "replace"))
    got = list(read_rows(src, BASE))
    assert len(got) == len(table)
    for row in got:
        assert (row.request is None) != (row.error is None)


def test_malformed_json_columns_are_error_rows_that_keep_their_ids(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_text(
        "id,prompt,messages,stop,response_format\n"
        "ok,fox,,,\n"
        'badjson,,"[{""role""",,\n'
        'badstop,fox,,"[""o""",\n'
        'badfmt,fox,,,"{""type"": ""regex"", ""pattern"": ""(""}"\n'
        "007,fox,,,\n"
        "00,fox,,,\n"
        "-0,fox,,,\n"
        "12345678901234567890123,fox,,,\n",
        encoding="utf-8",
    )
    got = list(read_rows(src, BASE))
    assert [r.id for r in got] == [
        "ok",
        "badjson",
        "badstop",
        "badfmt",
        "007",
        "00",
        "-0",
        "12345678901234567890123",
    ]
    assert [r.error is None for r in got] == [True, False, False, True, True, True, True, True]
    assert "messages" in got[1].error["message"] and "stop" in got[2].error["message"]


def test_a_bom_is_not_part_of_the_first_column(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_bytes(codecs.BOM_UTF8 + b"id,prompt\na,fox\nb,dog\n")
    got = list(read_rows(src, BASE))
    assert [(r.id, r.error) for r in got] == [("a", None), ("b", None)]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_bytes(codecs.BOM_UTF8 + b'{"id": "a", "prompt": "fox"}\n{"id": "b"}\n')
    assert [(r.id, r.error is None) for r in read_rows(jsonl, BASE)] == [("a", True), ("b", False)]


def test_a_utf16_jsonl_is_refused_naming_the_fix(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes('{"id": "a", "prompt": "fox"}\n'.encode("utf-16"))
    with pytest.raises(InvalidRequestError, match=r"UTF-16.*save it as UTF-8"):
        list(read_rows(src, BASE))


@settings(max_examples=150, deadline=None, suppress_health_check=_FIXTURE)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.builds(
                lambda i, p: json.dumps({"id": i, "prompt": p}, ensure_ascii=False).encode(),
                ids,
                prompts,
            ),
        ),
        max_size=8,
    ),
    st.booleans(),
)
def test_every_jsonl_line_gives_one_row(tmp_path: Path, lines: list[bytes], bom: bool) -> None:
    lines = [line.replace(b"\n", b" ").replace(b"\r", b" ") for line in lines]
    src = tmp_path / "in.jsonl"
    src.write_bytes((codecs.BOM_UTF8 if bom else b"") + b"\n".join(lines) + b"\n")
    got = list(read_rows(src, BASE))
    if not bom and lines and lines[0].startswith(codecs.BOM_UTF8):
        lines[0] = lines[0][len(codecs.BOM_UTF8) :]  # the file's own byte-order mark
    kept = [line for line in lines if line.strip()]  # blank lines are no rows
    assert len(got) == len(kept)
    for row, line in zip(got, kept, strict=True):
        assert (row.request is None) != (row.error is None)
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and isinstance(value.get("id"), str) and row.error is None:
            assert row.id == value["id"]


def test_the_real_process_writes_one_record_per_csv_row(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    src = tmp_path / "in.csv"
    src.write_bytes(
        codecs.BOM_UTF8
        + b"id,prompt,max_tokens,messages\n"
        + b"ok,fox,2,\n"
        + b'badjson,,2,"[{""role"""\n'
        + b"007,fox,2,\n"
        + b"00,dog,2,\n"
        + b"-0,cat,2,\n"
        + b"12345678901234567890123,x,2,\n"
        + b"\xff\xfe,fox,2,\n"
        + b"7,fox,2,\n"
    )
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "edgeinfer", "batch", str(tiny_llama_gguf), str(src)]
    done = subprocess.run(
        [*command, "-o", str(out), "--temperature", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in got] == [
        "ok",
        "badjson",
        "007",
        "00",
        "-0",
        "12345678901234567890123",
        8,  # its id is not text: the line number
        "7",
    ]
    assert [r["error"] is None for r in got] == [True, False, True, True, True, True, False, True]
    assert "DuplicateId" not in out.read_text(encoding="utf-8")
