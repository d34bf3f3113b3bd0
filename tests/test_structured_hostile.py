"""Hostile response_formats: every schema, regex, grammar or choice list either compiles or is
refused with InvalidRequestError before any token; none crashes the process (llguidance's
stack overflows are segmentation faults), in this process, in a child process whose calling
thread has a small stack, and through a real `edgeinfer serve`."""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.errors import InvalidRequestError
from edgeinfer.generation.sampling import SamplingConfig
from edgeinfer.generation.structured import check_response_format, compile_constraint
from edgeinfer.generation.structured_bounds import MAX_EXPANSION, MAX_SCHEMA_DEPTH
from edgeinfer.model import Model

from .fakes import FakeBackend, FakeTokenizer

pytest.importorskip("llguidance")

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = FakeTokenizer()


# -- hostile formats, from a seeded random source (shared with the child process) ----------


def _nested_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    schema: Any = {"type": rng.choice(["integer", "string", "boolean"])}
    for _ in range(depth):
        how = rng.randrange(4)
        if how == 0:
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        elif how == 1:
            schema = {"type": "array", "items": schema, "minItems": 1}
        elif how == 2:
            schema = {"anyOf": [schema, {"type": "null"}]}
        else:
            schema = {"allOf": [schema]}
    return schema


def _ref_chain(n: int, nested: bool) -> dict[str, Any]:
    """``$defs`` whose entries refer to the next, n deep (the measured crasher: 3,000)."""
    if nested:  # one object per level, each level's $defs holding the next
        inner: dict[str, Any] = {"type": "integer"}
        for i in range(n):
            inner = {"$defs": {f"d{i}": inner}, "$ref": f"#/$defs/d{i}"}
        return inner
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _wrong_types(rng: random.Random) -> dict[str, Any]:
    bad: list[Any] = [5, 2.5, None, True, [], {}, "x", 10**30, math.inf, "\ud800", ("t",)]
    key = rng.choice(["type", "properties", "required", "pattern", "items", "enum", "$ref"])
    return {"type": "object", key: rng.choice(bad), "\udc80" if rng.random() < 0.2 else "k": 1}


def hostile_schema(rng: random.Random) -> dict[str, Any]:
    how = rng.randrange(6)
    if how == 0:
        schema: Any = _nested_schema(rng, rng.choice([1, 5, 20, 40, 70, 200, 3000]))
    elif how == 1:
        schema = _ref_chain(rng.choice([10, 200, 300, 1_000, 5_000]), rng.random() < 0.5)
    elif how == 2:
        schema = _wrong_types(rng)
    elif how == 3:
        n = rng.choice([10, 500, 1_001, 5_000])
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    elif how == 4:
        schema = {"type": "string", "pattern": hostile_regex(rng)}
    else:  # self-reference, with huge counts
        n = rng.choice([0, 5, 10**6, 10**12])
        schema = {
            "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": n}},
            "$ref": "#/$defs/n",
        }
    return {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}


def hostile_regex(rng: random.Random) -> str:
    n = rng.choice([1, 10, 100, 1_000, 100_000, 10**7, 10**30])
    how = rng.randrange(7)
    if how == 0:
        return f"a{{{n}}}"
    if how == 1:
        m = min(n, 10**6)
        return f"(a{{{m}}}){{{m}}}"
    if how == 2:
        depth = rng.choice([5, 31, 40, 300, 3_000])
        return "(" * depth + "a" + ")" * depth
    if how == 3:
        return "[a-z]{2}" + "\ud800" + "x"
    if how == 4:
        return "|".join(f"w{i}" for i in range(min(n, 5_000)))
    if how == 5:
        return "[" * min(n, 2_000) + "a" + "]" * min(n, 2_000)
    return "".join(rng.choice("ab()[]{}|*+?\\.,0123456789^$-") for _ in range(rng.randrange(1, 60)))


def hostile_grammar(rng: random.Random) -> str:
    n = rng.choice([1, 10, 400, 600, 3_000, 10_000])
    how = rng.randrange(6)
    if how == 0:  # a chain of rules, each naming the next (the measured crasher: 3,000)
        return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "a"'])
    if how == 1:
        return "start: " + "(" * n + '"a"' + ")" * n
    if how == 2:
        count = rng.choice([10, 10_000, 100_000, 10**12])
        return f'start: "a"{{{count}}}'
    if how == 3:  # repetitions multiplied through rules: only the engine can tell
        return 'start: a{100}\na: b{100}\nb: "x"{100}'
    if how == 4:
        shallow = [
            _nested_schema(rng, rng.choice([3, 70, 300])),
            _ref_chain(300, False),
            {"type": "string", "pattern": hostile_regex(rng)},
        ]
        inner = json.dumps(rng.choice(shallow))
        return f"start: x\nx: %json {inner}"
    return "start: " + " | ".join(f'"x{i}"' for i in range(min(n, 3_000)))


def hostile_format(rng: random.Random) -> Any:
    how = rng.randrange(5)
    if how == 0:
        return hostile_schema(rng)
    if how == 1:
        return {"type": "regex", "pattern": hostile_regex(rng)}
    if how == 2:
        return {"type": "grammar", "lark": hostile_grammar(rng)}
    if how == 3:
        n = rng.choice([1, 999, 1_001, 3_000])
        choices: list[Any] = [f"c{i}" for i in range(n)]
        choices[0] = rng.choice(["ok", "\ud800", 5, "", "x" * 5_000])
        return {"type": "choice", "choices": choices}
    return rng.choice([{"type": "regex", "pattern": 5}, {"type": "grammar"}, [], "json"])


def outcome(fmt: Any, tokenizer: Any = TOKENIZER, steps: int = 8, seed: int = 0) -> str:
    """'ok' (compiled, and a few steps taken on random allowed tokens) or 'refused'; any
    other exception propagates (and fails the caller)."""
    try:
        checked = check_response_format(fmt)
        if checked is None:
            return "ok"
        constraint = compile_constraint(checked, tokenizer)
        rng = random.Random(seed)
        for _ in range(steps):
            if constraint.complete:
                break
            allowed = [int(i) for i in constraint.allowed().nonzero()[0]]
            token = rng.choice(allowed)
            if tokenizer.is_end_of_generation(token):
                break
            constraint.accept(token)
    except InvalidRequestError:
        return "refused"
    return "ok"


# -- in this process ------------------------------------------------------------------------

CASES = 200  # generated cases per hypothesis suite below


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_every_hostile_format_compiles_or_is_refused(seed: int) -> None:
    assert outcome(hostile_format(random.Random(seed)), seed=seed) in ("ok", "refused")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=30,
)


@settings(max_examples=CASES, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "type",
                "properties",
                "items",
                "pattern",
                "enum",
                "anyOf",
                "required",
                "$ref",
                "minLength",
                "maxItems",
            ]
        ),
        json_values,
        max_size=5,
    )
)
def test_random_schema_keywords_with_any_values(schema: dict[str, Any]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    assert outcome(fmt) in ("ok", "refused")


@settings(max_examples=CASES, deadline=None)
@given(st.text(min_size=1, max_size=80), st.sampled_from(["regex", "grammar", "choice"]))
def test_random_text_as_pattern_grammar_or_choice(text: str, kind: str) -> None:
    formats = {
        "regex": {"type": "regex", "pattern": text},
        "grammar": {"type": "grammar", "lark": text},
        "choice": {"type": "choice", "choices": [text, text + "x"]},
    }
    fmt = formats[kind]
    assert outcome(fmt) in ("ok", "refused")


@pytest.mark.parametrize(
    ("fmt", "why"),
    [
        ({"type": "regex", "pattern": "a{1000000}"}, "repetitions"),
        ({"type": "regex", "pattern": "(a{1000}){1000}"}, "repetitions"),
        ({"type": "regex", "pattern": "a\ud800"}, "lone surrogate"),
        ({"type": "regex", "pattern": "(" * 40 + "a" + ")" * 40}, "nest"),
        ({"type": "grammar", "lark": ""}, "non-empty"),
        ({"type": "grammar", "lark": 'start: "a"{100000}'}, "repetitions"),
        ({"type": "grammar", "lark": "\n".join(f"r{i}: r{i + 1}" for i in range(3000))}, "rules"),
        ({"type": "choice", "choices": [f"c{i}" for i in range(3000)]}, "more than 1000"),
        ({"type": "json_schema", "json_schema": {"schema": _ref_chain(300, True)}}, "nests"),
        ({"type": "json_schema", "json_schema": {"schema": _ref_chain(5000, False)}}, "entries"),
        (
            {
                "type": "json_schema",
                "json_schema": {"schema": _nested_schema(random.Random(1), 3000)},
            },
            f"deeper than {MAX_SCHEMA_DEPTH}",
        ),
        ({"type": "regex", "pattern": "[^\\s\\S]"}, "can match nothing"),
        (
            {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 2}},
            },
            "invalid",
        ),
    ],
)
def test_known_crashers_are_refused_naming_why(fmt: Any, why: str) -> None:
    with pytest.raises(InvalidRequestError, match=why):
        compile_constraint(fmt, TOKENIZER)


def test_expansion_bound_is_exact_at_the_limit() -> None:
    check_response_format({"type": "regex", "pattern": f"a{{{MAX_EXPANSION}}}"})
    with pytest.raises(InvalidRequestError, match="repetitions"):
        check_response_format({"type": "regex", "pattern": f"a{{{MAX_EXPANSION + 1}}}"})


def test_an_engine_limit_met_at_the_first_token_is_refused_before_any() -> None:
    # each rule is small; multiplied through the rules they exceed llguidance's item limit
    with pytest.raises(InvalidRequestError, match="grammar engine stopped"):
        compile_constraint(
            {"type": "grammar", "lark": 'start: a{100}\na: b{100}\nb: "x"{100}'}, TOKENIZER
        )


# -- through the generator (fake backend: llguidance is the only native code) ----------------


@pytest.fixture
def fake() -> Iterator[Model]:
    model = Model(FakeBackend(eos_boost=-50), name="fake", path=Path("fake"), model_format="fake")
    yield model
    model.close()


def test_logit_bias_banning_every_allowed_first_token_is_refused(fake: Model) -> None:
    fmt = {"type": "choice", "choices": ["yes", "no"]}
    bias = {ord("y"): -math.inf, ord("n"): -math.inf}
    with pytest.raises(InvalidRequestError, match="logit_bias bans"):
        fake.stream("Q:", max_new_tokens=5, response_format=fmt, logit_bias=bias)


def test_logit_bias_banning_every_allowed_later_token_raises_mid_stream(fake: Model) -> None:
    fmt = {"type": "regex", "pattern": "ab[0-9]"}
    bias = {ord(str(d)): -math.inf for d in range(10)}
    stream = fake.stream("Q:", max_new_tokens=8, response_format=fmt, logit_bias=bias)
    parts: list[str] = []
    with pytest.raises(InvalidRequestError, match=r"logit_bias bans .* after 2 generated"):
        for chunk in stream:
            parts.append(chunk.text)
    assert stream.result is None  # no finish_reason: the cut reply never looks finished
    assert fake.generate("Q:", max_new_tokens=2, temperature=0).text is not None


def test_an_engine_error_mid_reply_raises_not_a_clean_finish(fake: Model) -> None:
    # the branch after "b" multiplies past llguidance's item limit through its rules; the
    # compile-time probe follows the first allowed token ("a") and passes, and logit_bias
    # steers the reply into "b", where the engine fails only once generation reaches it
    lark = 'start: "a" | "b" x\nx: y{100}\ny: z{100}\nz: "x"{100}'
    fmt = {"type": "grammar", "lark": lark}
    stream = fake.stream("Q:", max_new_tokens=80, response_format=fmt, logit_bias={98: 100})
    with pytest.raises(InvalidRequestError, match="grammar engine stopped after 1 generated"):
        for _ in stream:
            pass
    assert stream.result is None


@pytest.mark.parametrize("streamed", [False, True])
def test_stop_strings_do_not_cut_a_structured_reply(fake: Model, streamed: bool) -> None:
    fmt = {"type": "regex", "pattern": "x, y, z"}
    stream = fake.stream("Q:", max_new_tokens=20, response_format=fmt, stop=[",", " y"])
    text = "".join(c.text for c in stream) if streamed else stream.collect().text
    assert text == "x, y, z" and stream.result is not None
    assert stream.result.finish_reason == "stop"
    # without a format the same stop string still ends the reply before it
    plain = fake.generate(
        "Q:", max_new_tokens=20, stop=[","], logit_bias={ord(","): 100}, temperature=0
    )
    assert plain.text == "" and plain.finish_reason == "stop"


def test_json_reply_parses_even_when_its_text_holds_a_stop_string(fake: Model) -> None:
    schema = {
        "type": "object",
        "properties": {"k": {"const": "a,b"}},
        "required": ["k"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    # JSON is written on one line (one space after ':' and ','), so the random model's love of
    # whitespace cannot run the reply to its length limit
    result = fake.generate("Q:", max_new_tokens=40, response_format=fmt, stop=[","])
    assert result.finish_reason == "stop" and result.parsed == {"k": "a,b"}, result.text


def test_sampling_config_refuses_hostile_formats_at_construction() -> None:
    with pytest.raises(InvalidRequestError, match="repetitions"):
        SamplingConfig(response_format={"type": "regex", "pattern": "a{99999999}"})


# -- in a child process: a crash there is a signal, not a failed assertion -----------------

_CHILD = textwrap.dedent(
    """
    import random, sys, threading
    sys.path.insert(0, {root!r})
    from tests.test_structured_hostile import hostile_format, outcome
    from tests.fakes import FakeTokenizer
    counts = {{"ok": 0, "refused": 0}}
    def work():
        tokenizer = FakeTokenizer()
        for seed in range({n}):
            counts[outcome(hostile_format(random.Random(seed)), tokenizer, seed=seed)] += 1
    # the caller's thread gets a small stack (2 MiB is the default where `ulimit -s` is
    # unlimited): the compile must not depend on it
    threading.stack_size(2 * 1024 * 1024)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(counts["ok"], counts["refused"])
    """
)
CHILD_CASES = 150


def test_a_child_compiling_hostile_formats_on_a_small_stack_survives() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(root=str(ROOT), n=CHILD_CASES)],
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    killed = signal.Signals(-done.returncode).name if done.returncode < 0 else ""
    assert done.returncode == 0, f"exit {done.returncode} {killed} {done.stderr[-2000:]}"
    ok, refused = map(int, done.stdout.split())
    assert ok + refused == CHILD_CASES and ok > 0 and refused > 0


# -- through a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_gguf: Path) -> Iterator[Any]:
    pytest.importorskip("llama_cpp")
    from .test_serve import _start

    yield from _start(tiny_llama_gguf)


SERVER_CASES = 12


def _deep_dumps(value: Any) -> str:
    """json.dumps of a format nested past the interpreter's default recursion limit."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return json.dumps(value, ensure_ascii=True)
    finally:
        sys.setrecursionlimit(limit)


def test_server_answers_hostile_formats_with_400_and_keeps_serving(server: Any) -> None:
    import httpx

    rng = random.Random(21)
    fixed: list[Any] = [
        {"type": "json_schema", "json_schema": {"schema": _ref_chain(3000, False)}},
        {"type": "json_schema", "json_schema": {"schema": _nested_schema(rng, 60)}},
        {"type": "regex", "pattern": "a{1000000}"},
        {"type": "regex", "pattern": "(a{1000}){1000}"},
        {"type": "grammar", "lark": "\n".join(f"r{i}: r{i + 1}" for i in range(3000))},
        {"type": "grammar", "lark": 'start: a{100}\na: b{100}\nb: "x"{100}'},
        {"type": "choice", "choices": [f"c{i}" for i in range(3000)]},
        {"type": "regex", "pattern": "[^\\s\\S]"},
    ]
    formats = fixed + [hostile_format(rng) for _ in range(SERVER_CASES - len(fixed))]
    url = f"{server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "Hi"}]
    with httpx.Client(timeout=120) as client:
        for fmt in formats:
            body = {"messages": messages, "max_tokens": 4, "response_format": fmt}
            r = client.post(url, content=_deep_dumps(body))
            assert r.status_code in (200, 400), (r.status_code, r.text[:500])
            if fmt in fixed:
                assert r.status_code == 400, fmt if len(str(fmt)) < 200 else str(fmt)[:200]
            assert server.process.poll() is None, "".join(server.log)[-2000:]
        r = client.post(url, json={"messages": messages, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_server_structured_reply_ignores_stop_strings(server: Any) -> None:
    import httpx

    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 30,
        "temperature": 0,
        "stop": [",", "b"],
        "response_format": {"type": "regex", "pattern": "a, b, c"},
    }
    for stream in (False, True):
        with httpx.Client(timeout=120) as client:
            r = client.post(f"{server.url}/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            assert choice["message"]["content"] == "a, b, c" and choice["finish_reason"] == "stop"
            continue
        events = [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
        ]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert text == "a, b, c" and events[-1]["choices"][0]["finish_reason"] == "stop"
