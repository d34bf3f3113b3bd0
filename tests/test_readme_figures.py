"""Every measured figure in the READMEs and the docs/ pages comes from a results file named
beside it.

A figure is a number with a unit of measure (``x``/``x``, ``%``, ``tok/s``, ``t/s``,
``texts/s``, ``MB``/``MiB``/``GB``/``GiB``, ``ms``/``µs``/``s``) in prose or a table cell, or
any number in a table that names a results file. Each one must appear in a JSON file under
``benchmarks/results/`` that is named in the same block (paragraph, list item or table) or,
failing that, in the same section (from its heading to the next heading of any level), with
the rounding it is written with (``22.2%`` matches 22.15..22.25, or 0.2215..0.2225 for a file
that stores a fraction; ``MB`` also matches bytes, ``ms`` also seconds).

A figure also counts as sourced when it is a column's total over sibling records of the
file (a profile's sum), a ratio (x, %) of two figures shown in the same section, or a
difference of two figures of its own block; only the page's own figures are combined, so a
stale ratio cannot match two unrelated numbers of a large file by chance.

Figures that are not measurements (a setting, a limit) are listed in NOT_MEASURED with the
reason, or marked in the page: ``<!-- illustrative: why -->`` anywhere in a block exempts
that block, and ``<!-- source: results/x.json -->`` names the file where the prose does not.
TO_SOURCE lists the figures still without a file (issue 28); it only shrinks. Numbers inside
code (fenced or `inline`) are not figures: they are commands and settings.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# the pages checked: both READMEs and every page of the docs site
READMES = (
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
)

_NUM = r"[+\-\u2212]?\d[\d,]*(?:\.\d+)?"
_UNIT = (
    r"(?:\u00d7|x(?![\w])|%|minutes|tok/s|t/s|tokens/s|texts/s"
    r"|MiB|MB|GiB|GB|KiB|KB|kB|ms|µs|s(?![\w/]))"
)
# "256-368 MB", "+0.8% to +6.2%", "1.06-1.19x": both ends are figures
FIGURE = re.compile(
    rf"(?<![\w.\-/])(?P<a>{_NUM})\s?(?:{_UNIT})?\s?(?:\u2013|-|to)\s?(?P<b>{_NUM})\s?(?P<ru>{_UNIT})"
    rf"|(?<![\w.\-/])(?P<n>{_NUM})\s?(?P<u>{_UNIT})"
)
TABLE_NUMBER = re.compile(rf"(?<![\w.\-/])(?P<n>{_NUM})(?![\w.])")
FILE_NAME = re.compile(r"[\w.\-*]+\.json")
SOURCE_NOTE = re.compile(r"<!--\s*source:([^>]*)-->")
ILLUSTRATIVE = "<!-- illustrative"
_SECONDS = {"s": 1.0, "ms": 1e-3, "\u00b5s": 1e-6, "minutes": 60.0}
_BYTE_UNITS = {"MB": 1e6, "MiB": 2**20, "GB": 1e9, "GiB": 2**30, "KB": 1e3, "kB": 1e3, "KiB": 1024}


# Figures that are settings or limits, not measurements: (page, figure as written without
# spaces, a piece of its line) -> why.
NOT_MEASURED = {
    ("README.md", "98MB", "from the package registry"): "the catalog file's size on the index",
    ("docs/index.md", "98MB", "from the package registry"): "the catalog file's size on the index",
    ("docs/index.md", "98MB", "GGUF Q4_1, 98 MB"): "the catalog file's size on the index",
    ("docs/strangers.md", "1MiB", ""): "an input limit",
    ("docs/batch.md", "1MiB", ""): "an input limit",
    ("docs/apps.md", "1MiB", ""): "an input limit",
    ("docs/strangers.md", "2s", "RENDER_DEADLINE_S"): "a limit (a constant)",
    ("docs/strangers.md", "16x", "that limit"): "a limit",
    ("docs/tools.md", "512KiB", "tools"): "an input limit",
    ("docs/apps.md", "75%", "plans within 75%"): "a setting",
    ("docs/apps.md", "512MiB", "to the OS"): "a setting",
    ("docs/structured-output.md", "8MiB", "3,000"): "the size of a hostile input that was tried",
    ("docs/structured-output.md", "64KiB", ""): "an input limit",
    ("docs/structured-output.md", "8KiB", "patterns"): "an input limit",
    ("docs/structured-output.md", "256MiB", "stack"): "a setting",
    ("benchmarks/README.md", "95%", "context to 95%"): "a setting (--fill)",
    ("docs/memory.md", "113MB", "fp32 embedding"): "computed: 49,152 x 576 float32 weights",
    ("docs/converting.md", "8", "8-bit for 5- and 6-bit"): "bit widths in a description",
    ("docs/converting.md", "5", "8-bit for 5- and 6-bit"): "bit widths in a description",
    ("docs/converting.md", "6", "8-bit for 5- and 6-bit"): "bit widths in a description",
}
# Figures still without a results file (issue 28): each is being sourced or removed. This
# list only shrinks; a figure added to a page must come with its file.
TO_SOURCE: set[tuple[str, str, str]] = set()  # every figure has its file now


def _excused(readme: str, figure: Figure, line: str) -> bool:
    written = figure.text + figure.unit
    for table in (NOT_MEASURED, TO_SOURCE):
        for where, text, piece in table:
            if where == readme and text == written and piece in line:
                return True
    return False


@dataclass(frozen=True)
class Figure:
    text: str  # the number as written
    unit: str
    line: int


@dataclass(frozen=True)
class Block:
    lines: tuple[int, int]
    text: str
    section: str  # the text of the whole section the block sits in
    is_table: bool


def _blocks(markdown: str) -> Iterator[Block]:
    """Paragraphs, list items and tables, code fences removed, with their section's text."""
    lines = markdown.splitlines()
    sections: list[tuple[int, int]] = []
    start, fenced = 0, False
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#") and i > start:
            sections.append((start, i))
            start = i
    sections.append((start, len(lines)))
    for lo, hi in sections:
        section = "\n".join(lines[lo:hi])
        current: list[int] = []
        fenced = False
        for i in range(lo, hi + 1):
            line = lines[i] if i < hi else ""
            if line.startswith("```"):
                fenced = not fenced
                yield from _close(current, lines, section)
                current = []
                continue
            if fenced:
                continue
            new_item = bool(re.match(r"\s*([-*]|\d+\.) ", line))
            kind_changes = current and (line.startswith("|") != lines[current[0]].startswith("|"))
            if not line.strip() or line.startswith("#") or new_item or kind_changes:
                yield from _close(current, lines, section)
                current = []
            if line.strip() and not line.startswith("#"):
                current.append(i)


def _close(current: list[int], lines: list[str], section: str) -> Iterator[Block]:
    if current:
        text = "\n".join(lines[i] for i in current)
        yield Block((current[0] + 1, current[-1] + 1), text, section, text.startswith("|"))


def _prose(text: str) -> str:
    """The text without inline code and HTML comments (numbers there are not figures)."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"!?\[[^\]]*\]\([^)]*\)", " ", text)  # images and links: keep no targets
    return re.sub(r"`[^`]*`", " ", text)


def figures(block: Block) -> list[Figure]:
    found: list[Figure] = []
    for offset, line in enumerate(block.text.splitlines()):
        text = _prose(line)
        number = block.lines[0] + offset
        if block.is_table and not set(text) <= set("|-: "):
            if offset == 0:
                continue  # the header row names columns
            for cell in text.split("|")[2:]:  # the first cell names the row
                with_units = _with_units(cell, number)
                found.extend(with_units)
                if not with_units:
                    found.extend(Figure(m["n"], "", number) for m in TABLE_NUMBER.finditer(cell))
            continue
        found.extend(_with_units(text, number))
    return found


def _with_units(text: str, number: int) -> list[Figure]:
    found = []
    for match in FIGURE.finditer(text):
        if match["a"]:
            found.append(Figure(match["a"], match["ru"], number))
            found.append(Figure(match["b"], match["ru"], number))
        else:
            found.append(Figure(match["n"], match["u"], number))
    return found


def _named_files(text: str) -> set[str]:
    names = set(FILE_NAME.findall(text))
    for note in SOURCE_NOTE.findall(text):
        names |= set(FILE_NAME.findall(note))
    return {path.name for name in names for path in RESULTS.glob(name) if path.is_file()}


def sources(block: Block) -> set[str]:
    return _named_files(block.text) | _named_files(block.section)


_NUMBERS: dict[str, list[float]] = {}


def _numbers_in(name: str) -> list[float]:
    """Every number in a results file, sorted: values and numbers written inside strings."""
    if name not in _NUMBERS:
        values: list[float] = []

        def walk(node: object) -> None:
            if isinstance(node, bool):
                return
            if isinstance(node, int | float):
                values.append(abs(float(node)))
            elif isinstance(node, str):
                values.extend(abs(float(n)) for n in re.findall(r"\d+(?:\.\d+)?", node))
            elif isinstance(node, dict):
                for key, value in node.items():
                    walk(key)
                    walk(value)
                values.extend(_column_totals(node.values()))
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(json.loads((RESULTS / name).read_text(encoding="utf-8")))
        _NUMBERS[name] = sorted(values)
    return _NUMBERS[name]


def _column_totals(children: object) -> list[float]:
    """Totals over sibling records ({"a": {"ms": 1}, "b": {"ms": 2}} -> 3): a profile's sum."""
    totals: dict[str, float] = {}
    for child in children:  # type: ignore[attr-defined]
        if isinstance(child, dict):
            for key, value in child.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    totals[key] = totals.get(key, 0.0) + abs(float(value))
    return list(totals.values())


def _candidates(figure: Figure) -> Iterator[tuple[float, float]]:
    """(value, half-width) pairs the file may hold for the figure as written."""
    written = figure.text.replace(",", "").replace("\u2212", "-").lstrip("+-")
    decimals = len(written.partition(".")[2])
    value, half = float(written), 0.5 * 10.0**-decimals * 1.0001
    yield value, half
    if figure.unit == "%":
        yield value / 100, half / 100
    if figure.unit in _BYTE_UNITS:
        scale = _BYTE_UNITS[figure.unit]
        yield value * scale, half * scale
        if figure.unit in ("MB", "MiB"):  # a file in MiB for a README in MB, and back
            yield value * 1e6 / 2**20, half * 1e6 / 2**20
            yield value * 2**20 / 1e6, half * 2**20 / 1e6
    if figure.unit in _SECONDS:  # the file may keep any time unit
        for scale in _SECONDS.values():
            ratio = _SECONDS[figure.unit] / scale
            yield value * ratio, half * ratio


def appears(figure: Figure, names: set[str]) -> bool:
    for name in names:
        numbers = _numbers_in(name)
        for value, half in _candidates(figure):
            i = bisect.bisect_left(numbers, value - half)
            if i < len(numbers) and numbers[i] <= value + half:
                return True
    return False


def _value(figure: Figure) -> float:
    return float(figure.text.replace(",", "").replace("\u2212", "-").lstrip("+-"))


@functools.cache
def _shown(section: str) -> frozenset[float]:
    return frozenset(_value(f) for b in _blocks(section) for f in figures(b)) - {0.0}


def derived(figure: Figure, block: Block) -> bool:
    """A ratio (x, %) of two figures shown in the same section, or a difference of two in the
    same block (same unit), each of them checked on its own.

    Only the page's own figures are combined, not every number of a results file, so that
    a stale ratio cannot match two unrelated numbers by chance.
    """
    (value, half), *_ = _candidates(figure)
    if figure.unit in ("\u00d7", "x", "%"):
        shown = _shown(block.section)
        for a in shown:
            for b in shown:
                ratio = a / b if figure.unit != "%" else (a / b - 1) * 100
                if abs(ratio - value) <= half:
                    return True
    same_unit = {_value(f) for f in figures(block) if f.unit == figure.unit}
    return any(abs(a - b - value) <= half for a in same_unit for b in same_unit)


def _cases() -> Iterator[tuple[str, Block]]:
    for readme in READMES:
        for block in _blocks(readme.read_text(encoding="utf-8")):
            if ILLUSTRATIVE not in block.text and figures(block):
                yield readme.relative_to(ROOT).as_posix(), block


@pytest.mark.parametrize("readme", [r.relative_to(ROOT).as_posix() for r in READMES])
def test_every_figure_appears_in_the_results_file_named_beside_it(readme: str) -> None:
    problems = []
    lines = (ROOT / readme).read_text(encoding="utf-8").splitlines()
    for where, block in _cases():
        if where != readme:
            continue
        names = sources(block)
        for figure in figures(block):
            if _excused(readme, figure, lines[figure.line - 1]):
                continue
            if not names:
                problems.append(f"{where}:{figure.line}: {figure.text}{figure.unit} names no file")
            elif not appears(figure, names) and not derived(figure, block):
                files = ", ".join(sorted(names))
                problems.append(f"{where}:{figure.line}: {figure.text}{figure.unit} not in {files}")
    assert not problems, "\n".join(problems)


def test_every_excuse_still_names_a_figure() -> None:
    """An entry of NOT_MEASURED or TO_SOURCE whose figure is gone is removed, not kept."""
    seen = set()
    for where, block in _cases():
        lines = block.text.splitlines()
        for figure in figures(block):
            line = lines[figure.line - block.lines[0]]
            for table in (NOT_MEASURED, TO_SOURCE):
                for key in table:
                    if key[0] == where and key[1] == figure.text + figure.unit and key[2] in line:
                        seen.add(key)
    stale = (set(NOT_MEASURED) | TO_SOURCE) - seen
    assert not stale, f"no longer on its page, remove: {sorted(stale)}"


def test_the_check_finds_a_wrong_figure() -> None:
    """The checker itself: a figure off by one in its last digit fails, a rounding passes."""
    section = "## Memory\n\nFrom `results/memory-gguf.json`: peak 183.9 MB, planned +7.7%.\n"
    (block,) = _blocks(section)
    found = figures(block)
    assert [(f.text, f.unit) for f in found] == [("183.9", "MB"), ("+7.7", "%")]
    assert sources(block) == {"memory-gguf.json"}
    assert all(appears(f, {"memory-gguf.json"}) for f in found)
    wrong = Figure("184.0", "MB", 1)
    assert not appears(wrong, {"memory-gguf.json"})
    assert not appears(Figure("7.9", "%", 1), {"memory-gguf.json"})
    table = "## T\n\n| run | tok/s |\n| --- | --- |\n| a | 12.5 |\n| b | 2.50 tok/s |\n"
    (block,) = _blocks(table)
    assert [(f.text, f.unit) for f in figures(block)] == [("12.5", ""), ("2.50", "tok/s")]
    code = "## C\n\n```sh\nrun --budget 512MB\n```\n\nuse `--budget 1GB` here, 3 s\n"
    assert [f.text for b in _blocks(code) for f in figures(b)] == ["3"]
