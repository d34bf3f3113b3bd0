"""Figures on the pages and the one field of one results file each comes from.

A figure is a number with a unit (``x``, ``%``, ``tok/s``, ``MB``, ``ms``, ``s`` ...), a number
with a decimal point, a load average (``load average 1.8 to 3.9``), or any number in
a table beside a results file (``*.json`` named in it or in the prose around it). Numbers in
code, links' targets and HTML comments are not figures.

Each block of a page (paragraph, list item, table) that holds figures has one ``Spec`` in
``tests/figure_sources*.py``: the page, a piece of the block's text that finds it, and one
entry per figure in the order they are written. An entry is either ``Src``: an expression
over named fields of results files (``Field``; derived figures such as a ratio are written as
the arithmetic of their fields) and the unit the page writes; or ``Given``: a figure that is
not a measurement (a setting, a limit, a target), with its text and why. A ``Src`` figure is
right when the value, rounded to the digits the page writes, is the written number.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from tests.figure_values import Expr, SourceError, expr_of, number_of

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ("README.md", "benchmarks/README.md",
         *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))  # fmt: skip


# -- what a figure is -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Src:
    """A measured figure: its expression and the unit the page writes it in."""

    expr: Expr
    unit: str


@dataclass(frozen=True)
class Given:
    """A figure that is not a measurement, with its text as written and why."""

    text: str
    why: str


@dataclass(frozen=True)
class Spec:
    page: str
    anchor: str  # a piece of the block's text that is in no other block of the page
    figures: tuple[Src | Given, ...]


def spec(page: str, anchor: str, *figures: Src | Given | list[Src | Given]) -> Spec:
    flat: list[Src | Given] = []
    for f in figures:
        flat.extend(f if isinstance(f, list) else [f])
    return Spec(page, anchor, tuple(flat))


def unit(name: str) -> Callable[[Expr | float], Src]:
    return lambda e: Src(expr_of(e), name)


bare, times, pct, mb, tps, ms, sec, us, texts_s, mb_s, load = (
    unit(u) for u in ("", "\u00d7", "%", "MB", "tok/s", "ms", "s", "µs", "texts/s", "MB/s", "load")
)


def frac_pct(e: Expr) -> Src:
    """A fraction in the file, written as a percentage."""
    return Src(e * 100, "%")


def mb_bytes(e: Expr) -> Src:
    return Src(e / 1e6, "MB")


def gb_bytes(e: Expr) -> Src:
    return Src(e / 1e9, "GB")


def given(text: str, why: str) -> Given:
    return Given(text, why)


# -- pages: blocks and the figures in them ----------------------------------------------


@dataclass(frozen=True)
class Block:
    page: str
    first_line: int  # 1-based
    text: str
    section: int  # the index of its section in the page
    is_table: bool
    context: str = ""  # the prose around a table: it names the table's file and machine
    near: tuple[int, ...] = ()  # the indexes of those prose blocks in the page's list

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()


def blocks(page: str, markdown: str | None = None) -> list[Block]:
    """Paragraphs, list items and tables (code fences and headings left out); a table's
    context is its section's heading and the prose just before and after it."""
    if markdown is None:
        markdown = (ROOT / page).read_text(encoding="utf-8")
    lines = markdown.splitlines()
    found: list[Block] = []
    current: list[int] = []
    fenced, section, headings = False, 0, [""]

    def close() -> None:
        if current:
            text = "\n".join(lines[i] for i in current)
            found.append(Block(page, current[0] + 1, text, section, text.startswith("|")))
            current.clear()

    for i, line in enumerate([*lines, ""]):
        if line.startswith("```"):
            close()
            fenced = not fenced
            continue
        if fenced:
            continue
        heading = line.startswith("#")
        item = bool(re.match(r"\s*([-*]|\d+\.) ", line))
        kind = current and line.startswith("|") != lines[current[0]].startswith("|")
        if not line.strip() or heading or item or kind:
            close()
        if heading:
            section += 1
            headings.append(line)
        if line.strip() and not heading:
            current.append(i)
    return _with_context(found, headings)


def _comment(b: Block) -> bool:
    return not re.sub(r"<!--.*?-->", "", b.text, flags=re.S).strip()


def _is_item(b: Block) -> bool:
    return bool(re.match(r"\s*([-*]|\d+\.) ", b.text))


def _with_context(found: list[Block], headings: list[str]) -> list[Block]:
    """A table's context: its heading, the prose just before and after it. A list item's:
    the paragraph that leads into its list (one that ends with a colon)."""
    out = []
    for i, b in enumerate(found):
        if _is_item(b):
            j = next((j for j in range(i - 1, -1, -1) if not _is_item(found[j])), None)
            lead = found[j] if j is not None else None
            if lead and lead.section == b.section and lead.text.rstrip().endswith(":"):
                b = replace(b, context=lead.text, near=(j,))
        elif b.is_table:
            before = [j for j in range(i - 1, -1, -1) if found[j].section == b.section]
            after = [j for j in range(i + 1, len(found)) if found[j].section == b.section]
            sides = [
                next((j for j in side if not _comment(found[j])), None) for side in (before, after)
            ]
            near = [j for j in sides if j is not None and not found[j].is_table]
            text = "\n".join([headings[b.section], *(found[j].text for j in near)])
            b = replace(b, context=text, near=tuple(near))
        out.append(b)
    return out


@dataclass(frozen=True)
class Figure:
    text: str  # the number as written, sign included
    unit: str  # normalised: x is the times sign, t/s and tokens/s are tok/s
    line: int  # 1-based, in the page
    row: int  # the line's index in its block
    start: int  # the number's span in that line
    end: int

    def __str__(self) -> str:
        return f"{self.text}{' ' if self.unit else ''}{self.unit}"


_NUM = r"[+\-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_UNITS = ("\u00d7", "x(?![\\w])", "%", "minutes", "tok/s", "t/s", "tokens/s", "texts/s",
          "MB/s", "MiB", "MB", "GiB", "GB", "KiB", "KB", "kB", "ms", "\u00b5s",
          "s(?![\\w/])")  # fmt: skip
_UNIT = "(?:" + "|".join(_UNITS) + ")"
_START = r"(?:(?<![\w.\-/\u2212+])|(?<=\d/))"  # not inside a word or a path; 6/7 are two
_END = r"(?![\w]|\.\d)"
_TO = r"(?:\s?(?:\u2013|-)\s?|\s+to\s+)"
_PATTERNS = {  # in the order they claim text
    "range": rf"{_START}(?P<a>{_NUM})\s?(?:{_UNIT})?{_TO}(?P<b>{_NUM})\s*(?P<u>{_UNIT})",
    "load": rf"\bload(?:\s+average)?(?:\s+(?:of|at|near|about|up\s+to|was|is))?\s+"
    rf"(?:about\s+|near\s+)?(?P<a>{_NUM})(?:{_TO}(?P<b>{_NUM}))?{_END}",
    "unit": rf"{_START}(?P<a>{_NUM})\s*(?P<u>{_UNIT})",
    "decimal": rf"{_START}(?P<a>[+\-\u2212]?\d+\.\d+){_END}",
    "bare_range": rf"{_START}(?P<a>{_NUM})(?:\u2013|-)(?P<b>{_NUM}){_END}",
    "number": rf"{_START}(?P<a>{_NUM}){_END}",
}
_COMPILED = {k: re.compile(v) for k, v in _PATTERNS.items()}
_SYNONYMS = {"x": "\u00d7", "t/s": "tok/s", "tokens/s": "tok/s"}
RESULTS_NAME = re.compile(r"[\w.\-]+\.json")


def blank(line: str) -> str:
    """The line with code, comments, images and link targets blotted out, each character
    by one that is neither a space nor a word (so spans still point into the line as
    written, and ``3,000 `$ref`s`` is no 3,000 s)."""
    for pattern in (r"<!--.*?-->", r"`[^`]*`", r"!\[[^\]]*\]\([^)]*\)", r"\]\([^)]*\)"):
        line = re.sub(pattern, lambda m: re.sub(r"[^\n]", "\x1a", m.group()), line, flags=re.S)
    return line


def _scan(text: str, kinds: tuple[str, ...]) -> Iterator[tuple[str, str, int, int]]:
    """(number, unit, start, end) in ``text``, each span claimed once."""
    taken: list[tuple[int, int]] = []
    found = []
    for kind in kinds:
        for m in _COMPILED[kind].finditer(text):
            if any(m.start() < b and a < m.end() for a, b in taken):
                continue
            taken.append(m.span())
            u = m.groupdict().get("u") or ("load" if kind == "load" else "")
            for g in ("a", "b"):
                if m.groupdict().get(g) is not None:
                    found.append((m.group(g), _SYNONYMS.get(u, u), m.start(g), m.end(g)))
    yield from sorted(found, key=lambda f: f[2])


def named_results(text: str) -> set[str]:
    """The results files a text names (``results/x.json``, ``x.json``)."""
    return {n for n in RESULTS_NAME.findall(text) if (RESULTS / n.rpartition("/")[2]).is_file()}


def is_figure_table(block: Block) -> bool:
    return block.is_table and bool(named_results(block.text + "\n" + block.context))


def figures(block: Block) -> list[Figure]:
    """The block's figures in the order written: a table's row by row (its first cell names
    the row and its header the columns), prose over its whole text (a figure and its unit
    may sit on two lines)."""
    if not block.is_table:
        lines = block.lines
        starts = [sum(len(x) + 1 for x in lines[:row]) for row in range(len(lines))]
        out = []
        for n, u, a, b in _scan(blank(block.text), ("range", "load", "unit", "decimal")):
            row = max(r for r, s in enumerate(starts) if s <= a)
            out.append(Figure(n, u, block.first_line + row, row, a - starts[row], b - starts[row]))
        return out
    lines = [blank(line) for line in block.lines]
    found: list[Figure] = []
    cells = ("range", "load", "unit", "bare_range", "number")
    kinds = cells if is_figure_table(block) else ("range", "load", "unit", "decimal")
    for row, text in enumerate(lines):
        if row == 0 or set(text) <= set("|-: "):
            continue  # the header names the columns; the rule under it
        first = text.find("|", text.find("|") + 1)
        text = " " * (first + 1) + text[first + 1 :]
        for n, u, a, b in _scan(text, kinds):
            found.append(Figure(n, u, block.first_line + row, row, a, b))
    return found


# -- the check ----------------------------------------------------------------------------


def _plain(number: str) -> str:
    return number.replace(",", "").replace("\u2212", "-").lstrip("+")


def _render(value: float, decimals: int) -> str:
    text = f"{value:.{decimals}f}"
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text


def decimals(number: str) -> int:
    return len(_plain(number).partition(".")[2])


def judge(figure: Figure, entry: Src | Given) -> str | None:
    """None when the figure is what its entry says, else why not."""
    written = _plain(figure.text) + figure.unit
    if isinstance(entry, Given):
        want = _plain(entry.text.replace(" ", "")).replace("x", "\u00d7")
        return None if written == want else f"{figure}: the source list gives {entry.text}"
    if figure.unit != entry.unit:
        return f"{figure}: written in {figure.unit or 'no unit'!r}, its source in {entry.unit!r}"
    try:
        value = number_of(entry.expr.value(), entry.expr)
    except (SourceError, ZeroDivisionError) as exc:
        return f"{figure}: {exc}"
    want = _render(value, decimals(figure.text))
    if _plain(figure.text) != want:
        return f"{figure}: {entry.expr} = {value:.6g}, written at this rounding {want}"
    return None


def check(block: Block, entries: tuple[Src | Given, ...]) -> list[str]:
    found = figures(block)
    where = f"{block.page}:{block.first_line}"
    problems = []
    for figure, entry in zip(found, entries, strict=False):
        why = judge(figure, entry)
        if why:
            problems.append(f"{block.page}:{figure.line}: {why}")
    if len(found) != len(entries):
        shown = ", ".join(str(f) for f in found[len(entries) :]) or "none"
        problems.append(f"{where}: {len(found)} figures, {len(entries)} sources (left: {shown})")
    return problems


def perturbed(block: Block, figure: Figure, factor: float) -> Block:
    """The block with one figure multiplied by ``factor`` and written with the same digits;
    a figure too coarse to move is stepped one unit of its last digit the same way."""
    plain = _plain(figure.text)
    d = decimals(figure.text)
    new = _render(float(plain) * factor, d)
    if new == plain:
        step = 10.0**-d * (1 if factor > 1 else -1)
        new = _render(float(plain) + step, d)
    if figure.text.startswith("+") and not new.startswith("-"):
        new = "+" + new
    if "," in figure.text:
        new = f"{float(new):,.{d}f}"
    lines = block.lines
    line = lines[figure.row]
    lines[figure.row] = line[: figure.start] + new + line[figure.end :]
    return replace(block, text="\n".join(lines))
