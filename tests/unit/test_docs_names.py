"""Every code name docs/design.md (and docs/api.md, when there is one) mentions exists.

A name counts when it is a dotted name whose first part is ``unickpt`` or one of its top-level
modules / packages (``format.names.printable``, ``unickpt.LoadOptions``,
``engine.load_pipeline._load_once``): it resolves when the longest importable module prefix
imports and the rest is a chain of attributes (a dataclass field counts as an attribute). A file
name (``engine/plan_cache.py``, ``tools/{merge,diff}.py``, ``tests/fixtures/contract.py``)
resolves when the file exists under the repository, ``src/`` or ``src/unickpt/``. Names relative
to another module (``read.read_metadata`` inside the engine's call order) are not checked.

The failure lists every unresolved name with its line, so renaming modules costs one run.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import itertools
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "src", "unickpt")
PAGES = ("docs/design.md", "docs/api.md")
PLACEHOLDERS = {"format/vN.py"}  # a pattern the page explains, not a file

DOTTED = re.compile(r"(?<![\w/.-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.{-])(?:[\w{},.-]+/)*[\w{},-]+\.py\b")
FILE_SUFFIXES = (".py", ".md", ".json", ".bin", ".toml", ".sh", ".txt")


def top_level_names() -> set[str]:
    names = {"unickpt"}
    for entry in os.listdir(PACKAGE):
        if entry.endswith(".py"):
            names.add(entry[:-3])
        elif os.path.isfile(os.path.join(PACKAGE, entry, "__init__.py")):
            names.add(entry)
    names.discard("__init__")
    return names


def expand_braces(path: str) -> list[str]:
    """``tools/{merge,diff}.py`` -> both paths."""
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def path_exists(path: str) -> bool:
    return any(os.path.exists(os.path.join(base, path)) for base in (REPO, os.path.join(REPO, "src"), PACKAGE))


def name_resolves(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "unickpt":
        parts = ["unickpt", *parts]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif attr in fields:
                obj = None  # a field without a class-level default: nothing further to follow
            else:
                return False
        return True
    return False


def mentioned(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(dotted names, file paths)`` with their line numbers."""
    tops = top_level_names()
    names, paths = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in PATH.finditer(line):
            if m.group(0) not in PLACEHOLDERS:
                paths.append((lineno, m.group(0)))
        for m in DOTTED.finditer(line):
            token = m.group(0)
            if token.endswith(FILE_SUFFIXES) or token.split(".")[0] not in tops:
                continue
            if line[m.end() : m.end() + 1] == "/":  # a folder name such as state.md/...
                continue
            names.append((lineno, token))
    return names, paths


def unresolved(page: str) -> list[str]:
    text = open(os.path.join(REPO, page)).read()
    names, paths = mentioned(text)
    bad = [f"{page}:{n}: name {name}" for n, name in names if not name_resolves(name)]
    for n, path in paths:
        bad += [f"{page}:{n}: file {p}" for p in expand_braces(path) if not path_exists(p)]
    return bad


def test_design_pages_name_only_what_exists():
    pages = [p for p in PAGES if os.path.exists(os.path.join(REPO, p))]
    assert "docs/design.md" in pages
    bad = [b for page in pages for b in unresolved(page)]
    assert not bad, f"{len(bad)} name(s) in the design pages do not exist any more:\n" + "\n".join(bad)


def test_the_check_sees_names_and_catches_a_wrong_one():
    names, paths = mentioned(
        "`format.names.printable`, `unickpt.LoadOptions.verify_checksums`, `engine/plan_cache.py`,\n"
        "`ops/{merge,nonexistent_tool}.py`, `planning.no_such_module`, read.read_metadata, docs/state.md"
    )
    assert [n for _, n in names] == [
        "format.names.printable",
        "unickpt.LoadOptions.verify_checksums",
        "planning.no_such_module",
    ]
    assert [p for _, p in paths] == ["engine/plan_cache.py", "ops/{merge,nonexistent_tool}.py"]
    assert [name_resolves(n) for _, n in names] == [True, True, False]
    assert [path_exists(p) for p in expand_braces(paths[1][1])] == [True, False]


def heading_anchors(path: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces -> -)."""
    text = open(path).read()
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_the_docs_pages_resolve():
    pages = [
        "README.md",
        *(
            os.path.relpath(p, REPO)
            for p in sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
        ),
    ]
    bad = []
    for page in pages:
        text = open(os.path.join(REPO, page)).read()
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            link = m.group(1)
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (
                os.path.normpath(os.path.join(REPO, os.path.dirname(page), path)) if path else os.path.join(REPO, page)
            )
            if not os.path.exists(target):
                bad.append(f"{page}: {link} (no such file)")
            elif anchor and target.endswith(".md") and anchor not in heading_anchors(target):
                bad.append(f"{page}: {link} (no such heading)")
    assert not bad, "\n".join(bad)
