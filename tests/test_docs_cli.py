"""docs/cli.md lists every subcommand and every flag of the ``edgeinfer`` parser.

The parser (``edgeinfer.cli.main.build_parser``) is walked, nested subcommands included, and
the page is read by its headings:

- each subcommand has a section headed ``edgeinfer SUB`` (``edgeinfer models fetch``) that
  names its positionals and every long option of its own flags (a flag with no long option:
  its short one);
- a flag of a named argparse group (``sampling``, ``structured output``, ``model``) is
  described once, in the section headed ``<group> flags``, and the subcommand's section says
  that it takes the group (``[model flags]``);
- the flags every command takes (``--debug``, ``--verbose``) and ``--version`` are in the
  section headed ``edgeinfer``;
- the other way round, a flag in a section's synopsis or in the first column of its table
  must be one the subcommand has, so a removed flag does not linger on the page.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgeinfer.cli.main import build_parser

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
_OWN_GROUPS = ("positional arguments", "options", "optional arguments")
_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


@dataclass(frozen=True)
class Command:
    path: str  # "edgeinfer models fetch"
    parser: argparse.ArgumentParser


def commands(parser: argparse.ArgumentParser, path: str = "edgeinfer") -> Iterator[Command]:
    yield Command(path, parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, f"{path} {name}")


def _key(heading: str) -> str:
    return re.sub(r"\s+", " ", heading.replace("`", "").replace("-", " ")).strip().lower()


def sections(markdown: str) -> dict[str, str]:
    """Each heading's text (normalized: no backticks, hyphens as spaces, lower case) -> the
    text up to the next heading. Lines inside code fences are never headings."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            current = found.setdefault(_key(heading.group(1)), [])
        else:
            current.append(line)
    return {k: "\n".join(v) for k, v in found.items()}


def _names(action: argparse.Action) -> list[str]:
    """What the page must write for an action: its long options, else its short one; a
    positional's metavar."""
    if not action.option_strings:
        return [str(action.metavar or action.dest.upper())]
    long = [s for s in action.option_strings if s.startswith("--")]
    return long or action.option_strings[:1]


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def _group_key(title: str) -> str:
    return _key(title.split("(")[0]) + " flags"


def _global_flags(top: argparse.ArgumentParser) -> set[str]:
    return {s for a in top._actions for s in a.option_strings}


def problems(page: str, top: argparse.ArgumentParser) -> list[str]:
    found = sections(page)
    shared = _global_flags(top)
    out = []
    for command in commands(top):
        own = found.get(_key(command.path))
        if own is None:
            out.append(f"{command.path}: no section headed `{command.path}`")
            continue
        for group in command.parser._action_groups:
            where, key = own, _key(command.path)
            if group.title not in _OWN_GROUPS:
                key = _group_key(str(group.title))
                if not _mentions(own, key):
                    out.append(f"{command.path}: its section does not say it takes {key}")
                where = found.get(key, "")
            for action in group._group_actions:
                if _skipped(action, command, shared):
                    continue
                for name in _names(action):
                    if not _mentions(where, name):
                        out.append(f"{command.path}: {name} is not in the section `{key}`")
    return out + _stale(found, top)


def _skipped(action: argparse.Action, command: Command, shared: set[str]) -> bool:
    if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
        return True
    if action.help == argparse.SUPPRESS:
        return True  # hidden on purpose
    is_sub = command.path != "edgeinfer"
    return is_sub and bool(action.option_strings) and set(action.option_strings) <= shared


def _stale(found: dict[str, str], top: argparse.ArgumentParser) -> list[str]:
    """Flags written in a subcommand's synopsis or table that neither it nor the commands
    nested under it have."""
    out = []
    for command in commands(top):
        text = found.get(_key(command.path), "")
        # a command's synopsis may show its nested commands' flags (`models fetch NAME --force`)
        known = {
            s for c in commands(command.parser) for a in c.parser._actions for s in a.option_strings
        }
        known |= _global_flags(top)
        written = _synopsis_and_table_flags(text)
        out += [
            f"{command.path}: the page lists {f}, the parser has no such flag"
            for f in written - known
        ]
    return out


def _synopsis_and_table_flags(text: str) -> set[str]:
    fences = re.findall(r"^```text\n(.*?)^```", text, flags=re.M | re.S)
    first_cells = re.findall(r"^\|([^|]*)\|", text, flags=re.M)
    written = "\n".join(fences + first_cells)
    return set(_FLAG.findall(re.sub(r"\b(edgeinfer|MODEL)\b", " ", written)))


def test_every_subcommand_and_flag_is_on_the_page() -> None:
    found = problems(PAGE.read_text(encoding="utf-8"), build_parser())
    assert not found, "docs/cli.md:\n" + "\n".join(found)


def test_the_walk_sees_every_subcommand() -> None:
    paths = {c.path for c in commands(build_parser())}
    for sub in ("run", "chat", "batch", "embed", "convert", "devices", "bench", "serve"):
        assert f"edgeinfer {sub}" in paths
    assert {"edgeinfer models list", "edgeinfer models fetch", "edgeinfer models path"} <= paths


def _toy_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="edgeinfer")
    top.add_argument("--debug", action="store_true")
    sub = top.add_subparsers(dest="command")
    run = sub.add_parser("run")
    run.add_argument("model", metavar="MODEL")
    run.add_argument("-p", "--prompt")
    run.add_argument("--debug", action="store_true")
    run.add_argument_group("sampling").add_argument("--seed")
    return top


_TOY_PAGE = """# CLI

## `edgeinfer`

`--debug`

## `edgeinfer run`

```text
edgeinfer run MODEL --prompt PROMPT [sampling flags]
```

## Sampling flags

| flag | what |
| --- | --- |
| `--seed S` | same seed |
"""


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda p: p, []),
        (lambda p: p.replace("`--seed S`", "`-s`"), ["edgeinfer run: --seed is not in"]),
        (lambda p: p.replace("--prompt PROMPT", "-p PROMPT"), ["edgeinfer run: --prompt is not"]),
        (lambda p: p.replace("MODEL --prompt", "--prompt"), ["edgeinfer run: MODEL is not"]),
        (lambda p: p.replace("## `edgeinfer run`", "## run"), ["edgeinfer run: no section"]),
        (lambda p: p.replace(" [sampling flags]", ""), ["does not say it takes sampling"]),
        (lambda p: p.replace("PROMPT [", "PROMPT [--gone] ["), ["the page lists --gone"]),
    ],
)
def test_the_check_finds_what_is_missing(edit: Callable[[str], str], expected: list[str]) -> None:
    """The checker itself, on a toy parser: a page that drops a flag, a positional, a
    subcommand's heading or a group's mention fails, and a flag the parser lacks is caught."""
    page = edit(_TOY_PAGE)
    found = problems(page, _toy_parser())
    assert len(found) == len(expected), found
    for problem, piece in zip(found, expected, strict=True):
        assert piece in problem, (problem, piece)
