"""The error tree's shape (issue 41 item 3): every raise in ``src/`` names a family or one of its
members, never the bare root ``CheckpointError``, and every family is importable from ``unickpt``.

Static (AST over ``src/unickpt``) and import-only: no checkpoint is written."""

from __future__ import annotations

import ast
import os

import unickpt
from unickpt import errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/unit/ -> the root
SRC = os.path.join(ROOT, "src", "unickpt")

FAMILIES = (
    "IntegrityError",
    "StateMismatchError",
    "CoordinationError",
    "ConcurrencyError",
    "ConfigurationError",
    "StorageError",
    "InternalError",
)


def _bare_raise_lines(source: str) -> list[int]:
    """The lines of ``source`` that raise the bare root: ``raise CheckpointError(...)``,
    ``raise CheckpointError``, ``raise errors.CheckpointError(...)``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        name = exc.id if isinstance(exc, ast.Name) else exc.attr if isinstance(exc, ast.Attribute) else None
        if name == "CheckpointError":
            out.append(node.lineno)
    return out


def _bare_root_raises() -> list[str]:
    """``path:line`` (relative to src/unickpt) of every bare-root raise under src/unickpt."""
    out = []
    for dirpath, _dirs, files in os.walk(SRC):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, SRC).replace(os.sep, "/")
                out += [f"{rel}:{line}" for line in _bare_raise_lines(open(path).read())]
    return sorted(out)


def test_issue41_item3_no_raise_of_the_bare_root_error():
    found = _bare_root_raises()  # every file of src/unickpt, none exempt
    assert found == [], f"raise a family of unickpt.errors (or a member), not the bare CheckpointError: {found}"


def test_issue41_item3_the_scan_finds_every_spelling():
    source = (
        "from unickpt.errors import CheckpointError, ConfigurationError\n"
        "from unickpt import errors\n"
        "def f():\n    raise CheckpointError('x')\n"  # line 4
        "def g():\n    raise errors.CheckpointError\n"  # line 6
        "def h():\n    raise ConfigurationError('y')\n"
        "def k():\n    try:\n        pass\n    except CheckpointError:\n        raise\n"
    )
    assert _bare_raise_lines(source) == [4, 6]


def test_issue41_item3_families_importable_from_unickpt():
    for name in FAMILIES:
        cls = getattr(unickpt, name)
        assert cls is getattr(errors, name), name
        assert issubclass(cls, unickpt.CheckpointError), name
        assert name in unickpt.__all__, name
    assert set(errors.__all__) <= set(unickpt.__all__)  # every class of the tree, members included
    ns: dict[str, object] = {}
    exec(f"from unickpt import {', '.join(FAMILIES)}", ns)
    assert all(ns[n] is getattr(errors, n) for n in FAMILIES)
