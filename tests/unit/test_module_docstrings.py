"""Every module under ``src/unickpt`` opens with a docstring saying what it is for and who calls
it (issue 41, item 5): a first line of what it is, and a body naming its callers or its place
(a module, a function, an entry point in double backticks, or in words: "called by", "used by").
A module added without one fails here with its path."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "unickpt"
# how a docstring names who uses the module: ``a.name``, or in words
NAMES_ITS_PLACE = re.compile(
    r"``[\w.]+``|\bcall|\bused by\b|\buses\b|\bimports?\b|\bentry point\b|\bruns? (by|from|on)\b",
    re.IGNORECASE,
)


def _docstring_problem(source: str) -> str | None:
    doc = ast.get_docstring(ast.parse(source))
    if not doc or not doc.strip():
        return "no module docstring"
    if len(doc.split()) < 8:
        return f"a docstring of {len(doc.split())} words says neither what it is for nor who calls it"
    if not NAMES_ITS_PLACE.search(doc):
        return "the docstring names no caller or place (``module.name``, 'called by', 'used by')"
    return None


def test_issue41_item5_every_module_has_a_docstring_saying_what_it_is_for_and_who_calls_it() -> None:
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        problem = _docstring_problem(path.read_text(encoding="utf-8"))
        if problem:
            problems.append(f"{path.relative_to(SRC.parent)}: {problem}")
    assert not problems, "\n".join(problems)


def test_issue41_item5_the_check_catches_a_module_without_one() -> None:
    assert _docstring_problem("import os\n") == "no module docstring"
    assert _docstring_problem('"""A coordinator."""\n').startswith("a docstring of 2 words")
    assert _docstring_problem('"""The one-process coordinator, with every collective answered at once."""\n')
    named = '"""The one-process coordinator: ``coordination.make_coordinator`` returns it without a group."""'
    assert _docstring_problem(named) is None
