"""The shape of JSON output: compact by default (free whitespace when asked), only named
properties unless the schema allows others (OpenAI's convention; plain JSON Schema on
request), and a reply cut by max_new_tokens flagged as incomplete."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgeinfer
from edgeinfer.errors import InvalidRequestError
from edgeinfer.generation.structured import compile_constraint, named_properties_only

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

# the issue's schema: three small objects, no additionalProperties anywhere
FRUITS = {
    "type": "object",
    "properties": {
        "fruits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "color": {"type": "string"},
                    "calories": {"type": "integer"},
                },
                "required": ["name", "color", "calories"],
            },
            "minItems": 3,
            "maxItems": 3,
        }
    },
    "required": ["fruits"],
}


def _fmt(schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}, **extra}


@pytest.fixture(scope="module")
def tiny(tiny_llama_gguf: Path) -> Iterator[edgeinfer.Model]:
    with edgeinfer.load(tiny_llama_gguf, context_length=256, threads=1) as model:
        yield model


def _takes(model: edgeinfer.Model, fmt: dict[str, Any], text: str) -> bool:
    """Whether the compiled format accepts ``text`` token by token."""
    tokenizer = model._backend.tokenizer
    constraint = compile_constraint(fmt, tokenizer)
    try:
        for token in tokenizer.encode(text, add_special=False, parse_special=False):
            constraint.accept(token)
    except InvalidRequestError:
        return False
    return constraint.accepting


def test_compact_by_default_free_whitespace_when_asked(tiny: edgeinfer.Model) -> None:
    indented = '{\n  "a": 1\n}'
    assert _takes(tiny, _fmt(OPEN), '{"a": 1}')
    assert not _takes(tiny, _fmt(OPEN), indented)
    assert not _takes(tiny, {"type": "json_object"}, '{"a":\n\n 1}')
    assert _takes(tiny, _fmt(OPEN, whitespace="free"), indented)
    assert _takes(tiny, {"type": "json_object", "whitespace": "free"}, '{"a":\n\n 1}')


def test_only_named_properties_unless_plain_json_schema_is_asked(tiny: edgeinfer.Model) -> None:
    extra = '{"a": 1, "b": 2}'
    assert not _takes(tiny, _fmt(OPEN), extra)
    assert _takes(tiny, _fmt(OPEN, schema_semantics="json-schema"), extra)
    allowed = {**OPEN, "additionalProperties": True}
    assert _takes(tiny, _fmt(allowed), extra)


@pytest.mark.parametrize(
    "extra", [{"whitespace": "pretty"}, {"whitespace": None}, {"schema_semantics": 1}]
)
def test_bad_options_are_refused(extra: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError, match=next(iter(extra))):
        edgeinfer.SamplingConfig(response_format=_fmt(OPEN, **extra))


def test_named_properties_only_walks_schemas_not_property_names() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "string"}}},
            "items": {"type": "array", "items": {"properties": {"y": {}}}},
        },
        "$defs": {"d": {"anyOf": [{"properties": {"z": {}}}, {"type": "null"}]}},
        "additionalProperties": {"properties": {"w": {}}, "additionalProperties": True},
    }
    before = copy.deepcopy(schema)
    out = named_properties_only(schema)
    assert schema == before  # a copy
    assert out["additionalProperties"]["additionalProperties"] is True  # said: kept
    props = out["properties"]
    assert set(props) == {"properties", "items"}  # no property named additionalProperties
    assert props["properties"]["additionalProperties"] is False
    assert props["items"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["$defs"]["d"]["anyOf"][1]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=30,
)


@given(schema=st.dictionaries(st.sampled_from(["properties", "items", "anyOf", "x"]), _JSON))
@settings(max_examples=80, deadline=None)
def test_named_properties_only_takes_any_json(schema: dict[str, Any]) -> None:
    out = named_properties_only(schema)
    assert json.loads(json.dumps(out)) == out  # still plain JSON
    try:  # and the whole format is checked or refused cleanly
        edgeinfer.SamplingConfig(response_format=_fmt(schema))
    except InvalidRequestError:
        pass


def test_a_cut_reply_is_flagged_and_logged(
    tiny: edgeinfer.Model, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="edgeinfer.generation.results"):
        r = tiny.generate(
            "Data:", temperature=1.0, seed=1, max_new_tokens=3, response_format=_fmt(FRUITS)
        )
    assert r.finish_reason == "length" and r.parsed is None and r.format_incomplete
    assert "response_format" in caplog.text
    plain = tiny.generate("Data:", temperature=0, max_new_tokens=3)
    assert not plain.format_incomplete


@pytest.mark.model
def test_default_model_fills_the_issues_schema_at_temperature_0_9(default_model: Any) -> None:
    closed = named_properties_only(FRUITS)
    messages = [
        {"role": "user", "content": "List three fruits with their colour and calories as JSON."}
    ]
    for seed in range(4):
        r = default_model.chat(
            messages, temperature=0.9, seed=seed, max_new_tokens=200, response_format=_fmt(FRUITS)
        )
        assert "\n" not in r.text, r.text  # compact: no blank indented lines
        if r.finish_reason == "length":
            assert r.format_incomplete and r.parsed is None
            continue
        assert r.finish_reason == "stop" and not r.format_incomplete, r.text
        jsonschema.validate(r.parsed, closed)  # no property the schema does not name
