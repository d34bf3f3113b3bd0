"""The docs site builds, and the README stays a page a newcomer reads in five minutes.

- ``mkdocs build --strict`` succeeds: mkdocs.yml turns every link, anchor and page-list
  problem into a warning, and ``--strict`` makes a warning fail the build; a copy of the docs
  with one broken link and one broken anchor must fail it (the check checks itself).
- README.md has at most 250 lines, keeps the two commands' marker blocks near the top (the
  test command is what ``.ci/run`` extracts), its relative links reach files and headings
  that exist, and docs/index.md shows the same two commands.

MkDocs and its Material theme come with the ``test`` extra, so a missing one fails here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_MAX_README_LINES = 250
_MARKERS = ("<!-- run-command -->", "<!-- test-command -->")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    for module in ("mkdocs", "material"):
        assert importlib.util.find_spec(module), f"{module} is missing: pip install -e '.[test]'"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)]
    return subprocess.run(
        [*argv, "-d", str(site)], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    done = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.glob("*.md")}
    for page in pages - {"index"}:
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "memory.md"
    text = page.read_text(encoding="utf-8")
    page.write_text(text + "\n[gone](no-such-page.md)\n", encoding="utf-8")
    done = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-page.md" in done.stderr, done.stderr
    page.write_text(text + "\n[gone](devices.md#no-such-heading)\n", encoding="utf-8")
    done = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-heading" in done.stderr, done.stderr


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= _MAX_README_LINES, (
        f"README.md has {len(lines)} lines, at most {_MAX_README_LINES}: "
        "move the reference to a page under docs/"
    )


def _command_after(text: str, marker: str) -> tuple[int, str]:
    """(line, command) of the first line of the ```sh fence after ``marker``, as .ci/run
    reads it."""
    lines = text.splitlines()
    start = lines.index(marker)
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("```sh"):
            return start + 1, lines[i + 1]
    raise AssertionError(f"no ```sh fence after {marker}")


@pytest.mark.parametrize("marker", _MARKERS)
def test_the_two_commands_sit_near_the_top_and_match_the_docs(marker: str) -> None:
    readme = README.read_text(encoding="utf-8")
    line, command = _command_after(readme, marker)
    before = readme.splitlines()[:line]
    assert sum(1 for x in before if x.startswith("## ")) <= 1, (
        f"{marker} is not in the README's first section"
    )
    assert command.strip() and not command.startswith("```"), f"an empty fence after {marker}"
    _, in_docs = _command_after((DOCS / "index.md").read_text(encoding="utf-8"), marker)
    assert in_docs == command, f"docs/index.md shows another command after {marker}"


def _slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) give a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"\s+", "-", text.strip())


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M)}


def test_the_readmes_links_reach_pages_and_headings() -> None:
    text = re.sub(r"^```.*?^```", "", README.read_text(encoding="utf-8"), flags=re.M | re.S)
    targets = [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    assert any(t.startswith("docs/") for t in targets), "the README links no docs page"
    for target in targets:
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else README
        assert file.exists(), f"README.md links {target}: no such file"
        if anchor:
            assert anchor in _anchors(file), f"README.md links {target}: no such heading"


def test_the_slug_is_the_one_mkdocs_makes() -> None:
    assert _slug("Install and first run") == "install-and-first-run"
    assert _slug("## `edgeinfer models fetch`".lstrip("# ")) == "edgeinfer-models-fetch"
    assert _slug("Serving: an OpenAI-compatible local server") == (
        "serving-an-openai-compatible-local-server"
    )
