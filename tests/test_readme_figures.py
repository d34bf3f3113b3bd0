"""Every measured figure in the READMEs and the docs/ pages is one field of one results file
under ``benchmarks/results/``, or an explicit expression of named fields (a ratio, MB from
bytes, a percentage), and equals it at the rounding the page writes (``tests/figures.py``;
the sources are in ``tests/figure_sources*.py``). Figures that are not measurements (a
setting, a limit, a target) are listed there as given, with their text and the reason.

The text around each figure agrees with what its file records: the machine it names is the
recorded CPU (a table names its machine; a file with no CPU, load or command is said to have
none), a figure from a run at load 2 or more (or of unknown load) is labelled loaded and
declares no target met (``tests/figure_conditions.py``). Every results file records its
command, CPU and SIMD flags, versions, threads, rounds and load before and after, or says
which of them it lacks (``"conditions": {"unrecorded": [...]}``); nothing was filled in.

The check checks itself: every figure multiplied by 0.9 and by 1.1 (written with the same
digits) must fail.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import figure_conditions as fc
from tests import figure_values as fv
from tests import figures as fg
from tests.figure_sources import SPECS


@functools.cache
def _page_blocks(page: str) -> tuple[fg.Block, ...]:
    return tuple(fg.blocks(page))


def _specs_of(page: str) -> list[fg.Spec]:
    return [s for s in SPECS if s.page == page]


def _matches(page: str) -> Iterator[tuple[int, fg.Block, fg.Spec | None]]:
    """Each block of the page that holds figures, with the one spec that finds it."""
    for i, block in enumerate(_page_blocks(page)):
        if fg.figures(block):
            found = [s for s in _specs_of(page) if s.anchor in block.text]
            yield i, block, found[0] if len(found) == 1 else None


def _paired(page: str) -> dict[int, list[tuple[fg.Figure, fg.Src | fg.Given]]]:
    return {
        i: list(zip(fg.figures(b), s.figures, strict=False))
        for i, b, s in _matches(page)
        if s is not None
    }


@pytest.mark.parametrize("page", fg.PAGES)
def test_every_figure_is_its_source_at_the_rounding_written(page: str) -> None:
    problems = []
    for _, block, spec in _matches(page):
        if spec is None:
            found = [s.anchor[:40] for s in _specs_of(page) if s.anchor in block.text]
            why = f"found by {len(found)} sources {found}" if found else "no source"
            shown = ", ".join(str(f) for f in fg.figures(block))
            problems.append(f"{page}:{block.first_line}: {why} for its figures {shown}")
            continue
        problems.extend(fg.check(block, spec.figures))
    assert not problems, "\n".join(problems)


def test_every_source_finds_one_block() -> None:
    stale = []
    for spec in SPECS:
        hits = [b for b in _page_blocks(spec.page) if spec.anchor in b.text and fg.figures(b)]
        if len(hits) != 1:
            stale.append(f"{spec.page}: {spec.anchor[:60]!r} finds {len(hits)} blocks")
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize("page", fg.PAGES)
def test_each_figure_file_is_named_beside_it(page: str) -> None:
    """The reader finds the file: it is named in the block, the prose around a table or
    the section."""
    problems = []
    blocks = _page_blocks(page)
    for i, pairs in _paired(page).items():
        block = blocks[i]
        section = "\n".join(b.text for b in blocks if b.section == block.section)
        named = {n.rpartition("/")[2] for n in fg.named_results(block.context + section)}
        for figure, entry in pairs:
            if isinstance(entry, fg.Src) and not entry.expr.files() <= named:
                missing = ", ".join(sorted(entry.expr.files() - named))
                problems.append(f"{page}:{figure.line}: {figure} comes from {missing}, not named")
    assert not problems, "\n".join(problems)


def _files(pairs: list[tuple[fg.Figure, fg.Src | fg.Given]], row: int | None = None) -> set[str]:
    return {
        f
        for figure, entry in pairs
        if isinstance(entry, fg.Src) and (row is None or figure.row == row)
        for f in entry.expr.files()
    }


def _load_labelled(pairs: list[tuple[fg.Figure, fg.Src | fg.Given]]) -> set[str]:
    return {
        f
        for figure, entry in pairs
        if isinstance(entry, fg.Src) and figure.unit == "load"
        for f in entry.expr.files()
    }


def _pieces(
    block: fg.Block, pairs: list[tuple[fg.Figure, fg.Src | fg.Given]]
) -> Iterator[tuple[str, set[str]]]:
    """A table's rows, a prose block's sentences: each with the files of its figures."""
    lines = fg.blank(block.text).split("\n")
    if block.is_table:
        for row, line in enumerate(lines):
            yield line, _files(pairs, row)
        return
    starts = [sum(len(x) + 1 for x in lines[:row]) for row in range(len(lines))]
    text = "\n".join(lines)
    for m in re.finditer(r".+?(?:[.;](?=\s)|$)", text, re.S):  # sentences and clauses
        inside = [(f, e) for f, e in pairs if m.start() <= starts[f.row] + f.start < m.end()]
        yield m.group(), _files(inside)


@pytest.mark.parametrize("page", fg.PAGES)
def test_the_text_says_the_machine_and_load_each_file_records(page: str) -> None:
    problems = []
    blocks = _page_blocks(page)
    paired = _paired(page)
    for i, pairs in paired.items():
        block = blocks[i]
        text = fg.blank(block.text + "\n" + block.context)
        files = _files(pairs)
        labelled = _load_labelled(pairs)
        for j in block.near:
            labelled |= _load_labelled(paired.get(j, []))
        section = "\n".join(b.text for b in blocks if b.section == block.section)
        said = fc.declared_by_file(section)  # a clause naming its file holds for the section
        found = fc.machine_problems(text, files, block.is_table, said)
        found += fc.load_problems(text, files, labelled, said)
        found += fc.command_problems(text, files, said)
        for piece, in_piece in _pieces(block, pairs):
            found += fc.met_problems(piece, in_piece) + fc.quiet_problems(piece, in_piece)
            found += fc.family_problems(piece, in_piece)
        problems.extend(f"{page}:{block.first_line}: {why}" for why in dict.fromkeys(found))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("file", fc.results_files())
def test_each_results_file_records_its_conditions_or_says_what_it_lacks(file: str) -> None:
    rec = fc.recorded(file)
    assert list(rec.unrecorded) == rec.missing(), (
        f"{file}: records no {rec.missing()}; its conditions.unrecorded says "
        f"{list(rec.unrecorded)} (write what is unknown, never a value made up afterwards)"
    )


def test_a_figure_off_by_ten_percent_is_caught() -> None:
    """The self-test: each figure of every page times 0.9 and times 1.1, written with the
    same digits (stepped one unit of its last digit when that rounds back), fails."""
    missed, tried = [], 0
    for page in fg.PAGES:
        for _, block, spec in _matches(page):
            if spec is None or fg.check(block, spec.figures):
                continue  # reported by the test above
            for figure in fg.figures(block):
                for factor in (0.9, 1.1):
                    tried += 1
                    if not fg.check(fg.perturbed(block, figure, factor), spec.figures):
                        missed.append(f"{page}:{figure.line}: {figure} x{factor}")
    assert tried > 1000 and not missed, f"{len(missed)} of {tried} passed:\n" + "\n".join(missed)


@pytest.mark.parametrize(
    ("page", "written", "wrong"),
    [
        ("docs/many-requests.md", "1.18x", "1.45x"),
        ("docs/memory.md", "0.874\u00d7", "0.701\u00d7"),
        ("docs/many-requests.md", "1.83x", "2.29x"),
    ],
)
def test_the_issues_wrong_figures_fail(page: str, written: str, wrong: str) -> None:
    """Issue 35: figures like these passed the old checker (any number of any file named
    nearby); the third stands in for one that has left the page."""
    hits = [(b, s) for _, b, s in _matches(page) if s is not None and written in b.text]
    assert hits, f"{written} is no longer on {page}"
    for block, spec in hits:
        assert not fg.check(block, spec.figures)
        bad = fg.Block(block.page, block.first_line, block.text.replace(written, wrong),
                       block.section, block.is_table, block.context)  # fmt: skip
        assert fg.check(bad, spec.figures), f"{wrong} passed on {page}"


def test_figures_are_read_as_written() -> None:
    text = (
        "## Memory\n\nFrom `results/memory-gguf.json`: peak 183.9 MB, planned +7.7%, at load "
        "average 1.8 to 3.9, top-1 0.9531, 1.06\u20131.19x, Python 3.10.\n\n"
        "| run | tok/s | MB |\n| --- | --- | --- |\n| a | 12.5 \u00b1 0.3 | 1,000 (86) |\n\n"
        "```sh\nrun --budget 512MB\n```\n\nuse `--budget 1GB` here, 3 s, 0.18.0, pp128\n"
    )
    got = [[(f.text, f.unit) for f in fg.figures(b)] for b in fg.blocks("x.md", text)]
    assert got == [
        [("183.9", "MB"), ("+7.7", "%"), ("1.8", "load"), ("3.9", "load"), ("0.9531", ""),
         ("1.06", "\u00d7"), ("1.19", "\u00d7"), ("3.10", "")],
        [("12.5", ""), ("0.3", ""), ("1,000", ""), ("86", "")],
        [("3", "s")],
    ]  # fmt: skip


def test_the_rounding_written_is_the_check() -> None:
    field = fv.Const(0.87549)
    figure = fg.Figure("0.876", "\u00d7", 1, 0, 0, 5)
    assert fg.judge(figure, fg.times(field)) is not None  # 0.87549 is 0.875 at 3 digits
    assert fg.judge(fg.Figure("0.88", "\u00d7", 1, 0, 0, 4), fg.times(field)) is None
    assert fg.judge(fg.Figure("0.88", "%", 1, 0, 0, 4), fg.times(field)) is not None  # unit
    assert fg.judge(fg.Figure("3", "\u00d7", 1, 0, 0, 1), fg.given("3x", "a target")) is None
    assert fg.judge(fg.Figure("4", "\u00d7", 1, 0, 0, 1), fg.given("3x", "a target"))


@settings(deadline=None)
@given(
    st.floats(min_value=-1e7, max_value=1e7, allow_nan=False),
    st.integers(min_value=0, max_value=6),
    st.sampled_from([0.9, 1.1]),
)
def test_any_value_at_its_rounding_passes_and_a_tenth_off_fails(
    value: float, digits: int, factor: float
) -> None:
    """For any value and any number of digits: the value written at that rounding is right,
    and the same figure a tenth off (or one unit of its last digit, when coarser) is not."""
    written = f"{value:.{digits}f}"
    written = written.lstrip("-") if not written.strip("-0.") else written
    (block,) = fg.blocks("x.md", f"## H\n\nThe peak was {written} MB here.\n")
    entries = (fg.mb(fv.Const(value)),)
    assert [str(f) for f in fg.figures(block)] == [f"{written} MB"]
    assert not fg.check(block, entries)
    (figure,) = fg.figures(block)
    assert fg.check(fg.perturbed(block, figure, factor), entries)


def test_the_rules_catch_what_issue_35_found() -> None:
    """A Xeon file under 'this AVX2-only CPU', a loaded file declaring a target met, a file
    with no load called quiet."""
    xeon, loaded, unknown = "bench-default.json", "prompt_cache.json", "serve.json"
    assert fc.recorded(xeon).family == "Xeon"
    assert fc.machine_problems("on this AVX2-only CPU (AMD EPYC)", {xeon}, False)
    assert fc.machine_problems("Measured on this machine:", {xeon}, True)
    assert not fc.machine_problems("on an Intel Xeon with AMX", {xeon}, True)
    assert fc.met_problems("| 0.149x | <= 0.15x: met, barely |", {loaded})
    assert not fc.met_problems("<= 0.15x: not met", {loaded})
    assert not fc.met_problems("not shown: measured at load 27", {loaded})
    assert fc.load_problems("on a quiet machine", {unknown}, set())
    assert not fc.load_problems("(`serve.json` records no load)", {unknown}, set())
    assert fc.declared_unrecorded("(`x.json` records no command, machine or load)") == {
        "command", "machine", "load"}  # fmt: skip
    assert fc.met_problems(
        "The issue's target holds on both sides: 1.023x", {"busy_cpu_quiet_hogs.json"}
    )
    assert not fc.met_problems("neither target, 1.5x and 1.2x, is shown met", {loaded})
