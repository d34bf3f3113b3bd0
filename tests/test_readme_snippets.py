"""README.md and the docs/ pages run as written: every fenced Python snippet and every
`edgeinfer ...` line of a shell fence is run, offline, so the pages cannot drift from the
product.

Convention: the HTML comment lines just above a fence (blank lines between are allowed) say
how to run it; a fence without one runs as it is.

- ``<!-- snippet: not-run REASON -->``: not run (installs packages, needs a cluster, a
  placeholder path, a long benchmark, or a fragment that needs context from around it).
  REASON is required, so every fence left out says why.
- ``<!-- snippet: with-server -->``: a Python snippet that talks to ``edgeinfer serve``: the
  test starts the server on the default model at a free port and points the snippet's
  ``127.0.0.1:8080`` at it.
- ``<!-- snippet: tiny-gguf NAME -->``: a shell fence whose commands name a GGUF file NAME:
  the test puts the session's tiny random GGUF there and runs the commands in that folder.

Python fences run as scripts in a fresh interpreter; in shell fences only lines that start
with ``edgeinfer`` are run (others -- pip, curl, systemctl -- are setup), each as
``python -m edgeinfer`` with its arguments split as the shell would (no pipes or
substitutions are allowed in such a line). The snippets use the default model, so the tests
are marked ``model``; a snippet must exit 0 and print no traceback. Outputs are not compared
with what a page shows: it shows what one machine printed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .leakcheck import KillAtEnd

ROOT = Path(__file__).resolve().parent.parent
# the pages whose snippets run: the README and every page of the docs site
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_RUN_LANGS = ("python", "sh", "bash")
_MARK = re.compile(r"<!--\s*snippet:\s*(not-run|with-server|tiny-gguf)\s*(.*?)\s*-->")
_TIMEOUT_S = 600  # one snippet; the machine may be loaded


@dataclass(frozen=True)
class Fence:
    page: str  # the page's path from the repository root
    line: int  # 1-based line of the opening ```
    lang: str
    body: str
    mark: str  # "" (run as it is), "not-run", "with-server" or "tiny-gguf"
    arg: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.lang}"


def fences(text: str, page: str = "README.md") -> list[Fence]:
    lines = text.split("\n")
    out: list[Fence] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        mark, arg = _mark_above(lines, i)
        body = "\n".join(lines[i + 1 : end])
        out.append(Fence(page, i + 1, opening.group(1), body, mark, arg))
        i = end + 1
    return out


def _mark_above(lines: list[str], i: int) -> tuple[str, str]:
    """The snippet comment among the comment lines just above line ``i``."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    while j >= 0 and lines[j].strip().startswith("<!--"):
        found = _MARK.search(lines[j])
        if found:
            return found.group(1), found.group(2)
        j -= 1
    return "", ""


def cli_lines(body: str) -> list[list[str]]:
    """The ``edgeinfer ...`` commands of a shell fence, continuation lines joined, comments
    dropped, as argument lists."""
    joined = re.sub(r"\\\n\s*", " ", body)
    commands = []
    for line in joined.split("\n"):
        words = shlex.split(line, comments=True)
        if words and words[0] == "edgeinfer":
            if any(w in ("|", ";", "&&", ">") or "$(" in w for w in words):
                raise AssertionError(f"not a plain command: {line!r}")
            commands.append(words[1:])
    return commands


ALL = [
    f
    for page in PAGES
    for f in fences(page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix())
    if f.lang in _RUN_LANGS
]
# what runs: Python fences, and shell fences with an edgeinfer line (curl, pip, ... are setup)
RUN = [f for f in ALL if f.mark != "not-run" and (f.lang == "python" or cli_lines(f.body))]


def test_the_convention_is_followed() -> None:
    for fence in ALL:
        if fence.mark == "not-run":
            assert fence.arg, f"{fence.id}: say why it is not run"
        if fence.mark == "with-server":
            assert fence.lang == "python" and "127.0.0.1:8080" in fence.body, fence.id
        if fence.lang != "python" and fence.mark != "not-run":
            cli_lines(fence.body)  # plain commands only
    assert any(f.lang == "python" for f in RUN) and any(f.mark == "with-server" for f in RUN)
    assert {f.page for f in ALL} >= {"README.md", "docs/generation.md"}, "a page was not read"


def test_the_parser_reads_marks_and_continuations() -> None:
    text = "\n".join(
        [
            "<!-- snippet: not-run needs a cluster -->",
            "<!-- run-command -->",
            "",
            "```sh",
            "pip install x",
            "edgeinfer run m \\",
            "    -p 'a b'  # note",
            "```",
            "```python",
            "print(1)",
            "```",
        ]
    )
    first, second = fences(text)
    assert (first.mark, first.arg, first.line) == ("not-run", "needs a cluster", 4)
    assert cli_lines(first.body) == [["run", "m", "-p", "a b"]]
    assert (second.mark, second.body) == ("", "print(1)")


def _run(argv: list[str], cwd: Path, what: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    out = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{out}"
    assert "Traceback" not in done.stderr, f"{what}:\n{out}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(default_gguf: Path, port: int, kill_at_end: KillAtEnd) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "edgeinfer", "serve", "smollm2-135m-instruct"]
    argv += ["--port", str(port), "--context-length", "1024"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_at_end(process)  # whatever happens: a graceful stop is the test's to check
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    pytest.fail("edgeinfer serve did not answer /health within 300 s")


@pytest.mark.model
@pytest.mark.parametrize("fence", RUN, ids=[f.id for f in RUN])
def test_snippet_runs(
    fence: Fence, default_gguf: Path, tiny_llama_gguf: Path, tmp_path: Path, kill_at_end: KillAtEnd
) -> None:
    if fence.mark == "tiny-gguf":
        shutil.copyfile(tiny_llama_gguf, tmp_path / fence.arg)
    if fence.lang != "python":
        commands = cli_lines(fence.body)
        for args in commands:
            _run([sys.executable, "-m", "edgeinfer", *args], tmp_path, f"{fence.id}: {args}")
        return
    body = fence.body
    server = None
    if fence.mark == "with-server":
        pytest.importorskip("openai")
        port = _free_port()
        server = _serve(default_gguf, port, kill_at_end)
        body = body.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    script = tmp_path / "snippet.py"
    script.write_text(body, encoding="utf-8")
    try:
        _run([sys.executable, str(script)], tmp_path, fence.id)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
