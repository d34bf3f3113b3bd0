"""`chat --session NAME`: a name is 1 to 64 letters, digits, '_', '-' or '.', starting with a
letter or digit, and nothing else becomes a folder name (a trailing newline passed the old
``^...$`` check, where ``$`` also matches before a final newline)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.cli.chat_session import SessionFiles
from edgeinfer.errors import InvalidRequestError

RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
GOOD = ["s1", "a", "A.b-c_d", "9" * 64, "x.."]
BAD = ["s1\n", "s1\r\n", "\ns1", "", ".", "..", ".hidden", "-x", "a/b", "a\\b", "a b",
       "a\x00b", "é", "s1\n\n", "9" * 65, "a\u2028", "\uff41"]  # fmt: skip


@pytest.mark.parametrize("name", GOOD)
def test_names_inside_the_rule_are_taken(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    assert SessionFiles(name).folder == tmp_path / "sessions" / name


@pytest.mark.parametrize("name", BAD)
def test_names_outside_the_rule_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequestError, match=r"--session .* is invalid"):
        SessionFiles(name)


@settings(max_examples=300, deadline=None)
@given(
    name=st.one_of(
        st.text(max_size=80),
        st.from_regex(RULE, fullmatch=False),
        st.builds(
            str.__add__,
            st.from_regex(RULE, fullmatch=True),
            st.sampled_from(["\n", "\r\n", "\r", " ", "\t", "\x00", "/", "\u2028"])
            | st.text(min_size=1, max_size=3),
        ),
    )
)
def test_a_name_is_taken_exactly_when_the_whole_of_it_fits_the_rule(name: str) -> None:
    """Any text (any code points, and rule-shaped text with anything around it)."""
    if RULE.fullmatch(name):
        assert SessionFiles(name).folder.name == name
    else:
        with pytest.raises(InvalidRequestError):
            SessionFiles(name)


@settings(max_examples=25, deadline=None)
@given(value=st.one_of(st.none(), st.integers(), st.binary(max_size=8), st.lists(st.text())))
def test_a_name_that_is_not_text_is_refused(value: object) -> None:
    with pytest.raises(InvalidRequestError):
        SessionFiles(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["s1\n", "../up", "s1\r"])
def test_the_real_cli_refuses_it_with_one_line_and_makes_no_folder(
    name: str, tmp_path: Path
) -> None:
    env = {**os.environ, "EDGEINFER_HOME": str(tmp_path)}
    argv = [sys.executable, "-m", "edgeinfer.cli", "chat", str(tmp_path / "none.gguf")]
    done = subprocess.run(
        [*argv, "--session", name], input="hello\n", capture_output=True, text=True,
        timeout=120, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode not in (0, -signal.SIGSEGV) and len(lines) == 1, done.stderr
    assert lines[0].startswith("edgeinfer: error: --session") and "invalid" in lines[0]
    assert not (tmp_path / "sessions").exists()
