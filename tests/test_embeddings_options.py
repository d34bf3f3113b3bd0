"""Options an embedding model has no use for (sequence slots, a prompt cache, a KV cache type,
a context length, flash attention, another engine) are refused with one typed error naming
the option, its CLI flag and what an embedding model takes, the same for an encoder folder
(ONNX) and an encoder GGUF (llama.cpp); at their defaults they pass."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.embedding.load import EMBEDDING_OPTIONS, refuse_generation_options
from edgeinfer.errors import InvalidRequestError

FORMATS = ["encoder", "gguf"]
DEFAULTS: dict[str, Any] = {
    "parallel": 1, "prompt_cache": None, "kv_dtype": "auto", "context_length": None,
    "context_overflow": "stop", "flash_attention": False, "engine": "auto",
}  # fmt: skip
ASKED: list[tuple[str, Any, str]] = [
    ("parallel", 4, "--parallel"), ("parallel", "auto", "--parallel"),
    ("prompt_cache", "/tmp/cache", "--prompt-cache"), ("prompt_cache", True, "--prompt-cache"),
    ("kv_dtype", "float16", "--kv-dtype"), ("context_length", 512, "--context-length"),
    ("context_overflow", "slide", "--context-overflow"),
    ("flash_attention", True, "--flash-attention"),
]  # fmt: skip


@pytest.mark.parametrize("model_format", FORMATS)
def test_the_defaults_pass(model_format: str) -> None:
    refuse_generation_options("bert", model_format, **DEFAULTS)
    refuse_generation_options("bert", model_format, prompt_cache=False)


@pytest.mark.parametrize("model_format", FORMATS)
@pytest.mark.parametrize(("key", "value", "flag"), ASKED)
def test_each_option_asked_for_is_refused_naming_it_and_what_applies(
    model_format: str, key: str, value: Any, flag: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        refuse_generation_options("bert", model_format, **{**DEFAULTS, key: value})
    message = str(caught.value)
    assert message.startswith(f"{key}={value!r}: bert is an embedding model")
    assert f"(no {flag})" in message and EMBEDDING_OPTIONS in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("model_format", "ok", "other"),
    [("encoder", "onnxruntime", "llama.cpp"), ("gguf", "llama.cpp", "onnxruntime")],
)
def test_engine_may_name_only_the_engine_that_runs_it(
    model_format: str, ok: str, other: str
) -> None:
    refuse_generation_options("bert", model_format, engine=ok)
    with pytest.raises(InvalidRequestError, match=f"run by {ok} only"):
        refuse_generation_options("bert", model_format, engine=other)


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True),
    st.text(max_size=12), st.binary(max_size=6), st.lists(st.integers(), max_size=3),
    st.sampled_from([1, 1.0, "1", "auto", "stop", "slide", "float16", 0, "", "llama.cpp"]),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    model_format=st.sampled_from(FORMATS),
    key=st.sampled_from(sorted(DEFAULTS)),
    value=_VALUES,
)
def test_any_value_is_either_the_default_or_one_typed_refusal(
    model_format: str, key: str, value: Any
) -> None:
    default = DEFAULTS[key]
    if key == "engine":
        allowed = {"auto", "onnxruntime" if model_format == "encoder" else "llama.cpp"}
        passes = isinstance(value, str) and value in allowed
    elif default is None or default is False:
        passes = value is None or value is False
    else:
        passes = type(value) is type(default) and value == default
    if passes:
        refuse_generation_options("bert", model_format, **{key: value})
    else:
        with pytest.raises(InvalidRequestError, match=f"^{key}="):
            refuse_generation_options("bert", model_format, **{key: value})
