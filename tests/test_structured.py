"""Structured output: every reply under a JSON schema, regex, choice or grammar conforms, on
both backends, streamed or not; bad formats are refused before any token."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import edgeinfer
from edgeinfer.errors import InvalidRequestError

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

# bounded schemas: every string, array and number has a limit, so random weights finish too
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["person", "active"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 4,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "score": {"type": "integer", "minimum": 10, "maximum": 99},
        },
        "required": ["count", "score"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
}


def _fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "test", "schema": schema}}


@pytest.fixture(scope="module", params=["gguf", "onnx"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny random Llama on llama.cpp and, built natively, on onnxruntime."""
    gguf = request.getfixturevalue("tiny_llama_gguf")
    path = gguf
    if request.param == "onnx":
        pytest.importorskip("onnxruntime")
        from edgeinfer.converters.onnx.folder import write_gguf_folder

        path = tmp_path_factory.mktemp("tiny-native")
        write_gguf_folder(gguf, path, max_context=256)
    with edgeinfer.load(path, context_length=256, threads=1) as model:
        yield model


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_weights_always_produce_valid_json(tiny: Any, name: str) -> None:
    schema = SCHEMAS[name]
    for seed in range(4):
        result = tiny.generate(
            "Data:", temperature=1.0, seed=seed, max_new_tokens=200, response_format=_fmt(schema)
        )
        assert result.finish_reason == "stop", (name, seed, result.text)
        jsonschema.validate(json.loads(result.text), schema)
        assert result.parsed == json.loads(result.text)


def test_regex_and_choice_match_on_random_weights(tiny: Any) -> None:
    for seed in range(4):
        r = tiny.generate(
            "Date:",
            temperature=1.0,
            seed=seed,
            max_new_tokens=40,
            response_format={"type": "regex", "pattern": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
        )
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.text), r.text
        assert r.finish_reason == "stop" and r.parsed is None  # not a JSON format
        c = tiny.generate(
            "Pick:",
            temperature=1.0,
            seed=seed,
            max_new_tokens=20,
            response_format={"type": "choice", "choices": ["yes", "no", "maybe later"]},
        )
        assert c.text in ("yes", "no", "maybe later")


def test_lark_grammar(tiny: Any) -> None:
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    r = tiny.generate(
        "T:", temperature=1.0, seed=3, max_new_tokens=60,
        response_format={"type": "grammar", "lark": lark},
    )  # fmt: skip
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", r.text), r.text


def test_streaming_keeps_the_text_contract(tiny: Any) -> None:
    schema = SCHEMAS["nested"]
    with tiny.stream(
        "Data:", temperature=1.0, seed=5, max_new_tokens=200, response_format=_fmt(schema)
    ) as stream:
        parts = [chunk.text for chunk in stream]
    result = stream.result
    assert result is not None and "".join(parts) == result.text
    jsonschema.validate(result.parsed, schema)


def test_running_out_of_tokens_is_length_and_no_parse(tiny: Any) -> None:
    r = tiny.generate(
        "Data:", temperature=1.0, seed=1, max_new_tokens=3, response_format=_fmt(SCHEMAS["nested"])
    )
    assert r.finish_reason == "length" and r.parsed is None


def test_sampling_settings_still_apply_under_a_grammar(tiny: Any) -> None:
    fmt = {"type": "choice", "choices": ["alpha", "beta", "gamma", "delta"]}
    seen = {
        tiny.generate("X:", temperature=1.5, seed=s, max_new_tokens=10, response_format=fmt).text
        for s in range(12)
    }
    assert len(seen) > 1  # sampled, not always the same choice
    greedy = {
        tiny.generate("X:", temperature=0, seed=s, max_new_tokens=10, response_format=fmt).text
        for s in range(3)
    }
    assert len(greedy) == 1


@pytest.mark.parametrize(
    ("fmt", "why"),
    [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "nonsense"),
        ({"type": "regex", "pattern": "(unclosed"}, "invalid"),
        ({"type": "grammar", "lark": "start: undefined_rule"}, "invalid"),
        ({"type": "choice", "choices": []}, "non-empty list"),
        ({"type": "xml"}, "type is one of"),
        ("json", "expected an object"),
    ],
)
def test_bad_formats_are_refused_before_any_token(tiny: Any, fmt: Any, why: str) -> None:
    with pytest.raises(InvalidRequestError, match=why):
        tiny.stream("x", max_new_tokens=5, response_format=fmt)
    assert tiny.generate("x", max_new_tokens=2, temperature=0).text is not None  # still usable


# -- the default model ---------------------------------------------------------------------

_PROMPTS = {
    "nested": "Alice is 31 years old and her account is active. Give her record as JSON.",
    "array_of_enums": "List the colors of a traffic light as a JSON array.",
    "bounded_numbers": "Return JSON with a count of 3 and a score of 42.",
    "optional_fields": "Create a JSON record with id 7 and the note 'urgent'.",
    "string_pattern": "The meeting is on 2024-05-17. Return the date as JSON.",
}


@pytest.mark.model
def test_default_model_answers_validate(default_model: Any) -> None:
    for name, schema in SCHEMAS.items():
        messages = [{"role": "user", "content": _PROMPTS[name]}]
        r = default_model.chat(
            messages, temperature=0, max_new_tokens=200, response_format=_fmt(schema)
        )
        assert r.finish_reason == "stop", (name, r.text)
        jsonschema.validate(r.parsed, schema)
    question = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    answers = [
        default_model.chat(question, temperature=0, max_new_tokens=5,
                           response_format={"type": "choice", "choices": options}).text
        for options in (["yes", "no"], ["no", "yes"], ["no"])
    ]  # fmt: skip
    assert answers[0] == answers[1] and answers[2] == "no"  # order-free; a lone option forced
    # the model's own preference between the two, without a grammar, in this run: both
    # options' first tokens lifted far above the rest, one greedy step
    (yes,), (no,) = (default_model.tokenize(w, add_special=False) for w in ("yes", "no"))
    step = default_model.generate(default_model.apply_chat_template(question), temperature=0,
                                  max_new_tokens=1, logit_bias={yes: 100.0, no: 100.0})  # fmt: skip
    assert step.token_ids[0] in (yes, no)
    assert answers[0] == ("yes" if step.token_ids[0] == yes else "no"), step.text


# -- CLI -----------------------------------------------------------------------------------


def test_cli_choice_and_json_schema(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "edgeinfer.cli", "run", str(tiny_llama_gguf), "-p", "Hi"]
    base += ["--threads", "1", "--context-length", "256", "--temperature", "1", "--seed", "2"]
    done = subprocess.run([*base, "--choice", "yes,no"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("yes", "no")
    schema_file = tmp_path / "record.json"
    schema_file.write_text(json.dumps(SCHEMAS["bounded_numbers"]))
    done = subprocess.run(
        [*base, "-n", "100", "--json-schema", str(schema_file)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), SCHEMAS["bounded_numbers"])
    schema_file.write_text("{not json")
    bad = subprocess.run([*base, "--json-schema", str(schema_file)], capture_output=True, text=True)
    assert bad.returncode == 1 and "is not JSON" in bad.stderr


def test_server_passes_response_format(tiny_llama_gguf: Path) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from edgeinfer.serve.app import create_app
    from edgeinfer.serve.config import ServerConfig

    with edgeinfer.load(tiny_llama_gguf, context_length=256, threads=1) as model:
        app = create_app(model, ServerConfig(name="m"))
        client = TestClient(app, base_url="http://127.0.0.1")  # a Host the server answers
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            ("/v1/completions", {"prompt": "Hi"}),
        ):
            schema = SCHEMAS["optional_fields"]
            r = client.post(
                path,
                json={**body, "max_tokens": 100, "seed": 1, "response_format": _fmt(schema)},
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            jsonschema.validate(json.loads(text), schema)
        r = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": 3}},
            },
        )
        assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]
