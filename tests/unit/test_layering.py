"""The layering of ``src/unickpt`` (issue 41 item 3): which package may import which, as a table
of allowed edges (``ALLOWED``), checked over every import of every module (also imports inside
functions and under ``TYPE_CHECKING``). A new import across packages fails here until the table
says it is meant; the rules the design names are asserted on their own below the table.

"Package": a folder under src/unickpt (``engine``, ``planning`` ...) or a top-level module
(``checkpointer``, ``errors`` ...); ``unickpt`` is the package's own ``__init__`` (its public
names, as ``from unickpt import load`` / ``from .. import load`` reach them).
Static (AST), no import of unickpt."""

from __future__ import annotations

import ast
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/unit/ -> the root
SRC = os.path.join(ROOT, "src", "unickpt")

# package -> the packages it may import (besides itself). Lower layers first.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_lazy": set(),
    "storage": {"errors"},
    # format -> state: format.build imports state.loader (the dataloader metadata section), the one
    # upward edge the architecture review of 2026-12-02 lists (§2.1)
    "format": {"_lazy", "errors", "state"},
    "planning": {"_lazy", "errors", "format"},
    "coordination": {"_lazy", "errors", "format"},
    "testing": {"coordination", "errors", "format"},
    "monitoring": {"errors", "format", "storage"},
    "folder": {"coordination", "errors", "format", "planning", "storage"},
    "options": {"coordination", "format", "storage"},
    "frameworks": {"errors", "format", "planning"},
    "state": {"_lazy", "errors", "format", "frameworks", "planning"},
    "data": {"errors", "state"},
    "engine": {
        "coordination",
        "errors",
        "folder",
        "format",
        "frameworks",
        "monitoring",
        "options",
        "planning",
        "state",
        "storage",
    },
    "checkpointer": {"coordination", "engine", "errors", "folder", "format", "monitoring", "options", "storage"},
    "api": {"checkpointer", "engine", "errors", "folder", "format", "options"},
    "manager": {"checkpointer", "coordination", "engine", "errors", "folder", "format", "options", "storage"},
    # recovery -> coordination: the RAM tier's group exchanges its values through coordination.objects
    "recovery": {"coordination", "errors", "folder", "format", "manager", "storage"},
    "tiering": {
        "checkpointer",
        "engine",
        "errors",
        "folder",
        "format",
        "manager",
        "monitoring",
        "ops",
        "options",
        "recovery",
        "storage",
    },
    "ops": {
        "unickpt",  # convert and modify save through unickpt.save
        "coordination",
        "engine",
        "errors",
        "folder",
        "format",
        "frameworks",
        "monitoring",
        "planning",
        "state",
        "storage",
    },
    "cli": {"unickpt", "errors", "folder", "manager", "monitoring", "ops", "storage"},
    "integrations": {"unickpt", "engine", "errors", "folder", "format", "ops", "options", "storage"},
    "unickpt": {
        "_lazy",
        "api",
        "checkpointer",
        "coordination",
        "data",
        "errors",
        "format",
        "frameworks",
        "manager",
        "options",
    }
    | {"state", "tiering"},
    "__main__": {"cli"},
}

# what the engine may use of frameworks: the adapter protocol and registry (the package itself),
# the plain tensors an adapter names for resizing, and the DTensor boxes of the HF export
ENGINE_FROM_FRAMEWORKS = {"frameworks", "frameworks.plain", "frameworks._fsdp_internals"}


def _units() -> set[str]:
    names = {n.removesuffix(".py") for n in os.listdir(SRC) if n.endswith(".py") or os.path.isdir(os.path.join(SRC, n))}
    return {"unickpt" if n == "__init__" else n for n in names if n != "__pycache__"}


@functools.cache
def imports() -> tuple[tuple[str, str, str], ...]:
    """(importing package, imported package, imported module path) for every import in src/unickpt
    whose target is another package of unickpt."""
    units = _units()
    out = []
    for dirpath, _dirs, files in os.walk(SRC):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, SRC).replace(os.sep, "/")
            me = "unickpt" if rel == "__init__.py" else rel.split("/")[0].removesuffix(".py")
            here = rel.split("/")[:-1]  # the package the module is in, relative to unickpt
            for node in ast.walk(ast.parse(open(path).read(), path)):
                for target in _targets(node, here):
                    other = target[0] if target and target[0] in units else "unickpt"
                    if other != me:
                        out.append((me, other, ".".join(target) or "unickpt"))
    return tuple(out)


def _targets(node: ast.AST, here: list[str]) -> list[list[str]]:
    """The unickpt module paths (relative to unickpt) an import node reaches."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "unickpt"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        if not node.module or node.module.split(".")[0] != "unickpt":
            return []
        base = node.module.split(".")[1:]
    else:
        if node.level - 1 > len(here):
            return []
        base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    if node.module and base:
        return [base]
    return [base + [a.name] for a in node.names]  # from . import x / from unickpt import x


def test_issue41_item3_every_import_across_packages_is_an_allowed_edge():
    found = imports()
    assert len({(a, b) for a, b, _ in found}) > 50  # the scan sees the graph
    units = _units()
    assert set(ALLOWED) >= units, sorted(units - set(ALLOWED))
    bad = sorted({f"{a} -> {path}" for a, b, path in found if b not in ALLOWED.get(a, set())})
    assert bad == [], f"imports the layering table (tests/unit/test_layering.py ALLOWED) does not allow: {bad}"


def test_issue41_item3_the_rules_of_the_design_hold():
    edges = {(a, b) for a, b, _ in imports()}
    assert not {("planning", x) for x in ("engine", "storage", "folder", "frameworks", "state")} & edges
    assert not {("frameworks", x) for x in ("engine", "state", "checkpointer", "ops")} & edges
    assert not {(x, y) for x in ("engine", "frameworks", "planning", "state") for y in ("cli", "integrations")} & edges
    assert not {("storage", x) for x in ALLOWED if x != "errors"} & edges
    engine_uses = {path for a, b, path in imports() if a == "engine" and b == "frameworks"}
    engine_uses = {".".join(p.split(".")[:2]) for p in engine_uses}
    assert engine_uses <= ENGINE_FROM_FRAMEWORKS, sorted(engine_uses - ENGINE_FROM_FRAMEWORKS)


def test_issue41_item3_the_scan_resolves_relative_and_absolute_imports():
    cases = [
        ("from ...frameworks.flat import FlatTensors", ["engine", "load"], [["frameworks", "flat"]]),
        ("from .. import load, errors", ["integrations"], [["load"], ["errors"]]),
        ("from unickpt.engine import x", ["ops"], [["engine"]]),
        ("import unickpt.cli.main", ["engine"], [["cli", "main"]]),
        ("from . import pieces", ["ops"], [["ops", "pieces"]]),
        ("import torch", ["engine"], []),
    ]
    for source, here, want in cases:
        got = [t for node in ast.walk(ast.parse(source)) for t in _targets(node, here)]
        assert got == want, (source, got)
