"""The integrations, the examples and the code of README.md and docs/guide/ use unickpt only
through its public names (issue 29, item 6: internals clearly private).

Public: a dotted name docs/api.md lists after its introduction (whose paragraph names the
internal packages), an attribute of a listed object (``unickpt.SaveHandle.wait``), or a name a
listed *module* offers (its ``__all__``, else what it binds), not starting with ``_`` and not one
of its submodules. Imports
(``import``, ``from ... import``, relative ones resolved; inside functions too) and attribute
chains on an imported ``unickpt`` (``unickpt.engine.x``) are read with ``ast``, nothing is
imported. An integration's imports of its own package (``from ._delete import ...``) are its
business. ``INTERNAL_USES`` lists the internals an integration still needs, each with the public
call it lacks; an entry no longer used fails the test, so the list only shrinks.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")
API_MD = os.path.join(ROOT, "docs", "api.md")
INTEGRATIONS = "unickpt.integrations"

INTERNAL_USES = {  # (module, internal dotted name) -> the public call that would replace it
    ("unickpt.integrations._delete", "unickpt.folder.cleanup.delete_checkpoint"): "deleting one checkpoint's own files",
    ("unickpt.integrations.torchtitan", "unickpt.folder.cleanup.delete_checkpoint"): "the same, under the job's locks",
    ("unickpt.integrations.torchtitan", "unickpt.format.records.METADATA_FILE"): "is this folder a checkpoint",
    ("unickpt.integrations.hf_trainer", "unickpt.format.records.METADATA_FILE"): "is this folder a checkpoint",
    ("unickpt.integrations.torchtitan", "unickpt.engine.export.hf.export_pieces"): "export_hf of renamed tensors",
    ("unickpt.integrations.torchtitan", "unickpt.engine.export.hf.pieces_of_tensors"): "the same",
    ("unickpt.integrations.lightning", "unickpt.format.values.dumps_value"): "a dict in the no-pickle value encoding",
    ("unickpt.integrations.lightning", "unickpt.format.values.loads_value"): "the same, decoded",
}


def _module_file(dotted: str) -> str | None:
    base = os.path.join(SRC, *dotted.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _public_names() -> set[str]:
    text = open(API_MD, encoding="utf-8").read()
    listed = text[text.index("\n## ") :]  # the introduction names the internal packages
    return set(re.findall(r"`(unickpt(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", listed))


def _exports(path: str) -> set[str]:
    """The names the module at ``path`` offers: its ``__all__`` where it has one, else every
    name it binds at its top level (read, not imported)."""
    bound = set()
    for node in ast.parse(open(path, encoding="utf-8").read(), path).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                return set(ast.literal_eval(node.value))
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names}
    return bound


def is_public(dotted: str, public: set[str]) -> bool:
    parts = dotted.split(".")
    if parts == ["unickpt"]:
        return True
    for k in range(len(parts), 1, -1):
        head = ".".join(parts[:k])
        if head not in public:
            continue
        module = _module_file(head)
        if k == len(parts) or module is None:  # the name itself, or an attribute of a listed object
            return True
        name = parts[k]  # a name a listed module offers, not a submodule, not private
        return not name.startswith("_") and _module_file(f"{head}.{name}") is None and name in _exports(module)
    return False


def used_names(tree: ast.AST, module: str | None = None) -> list[tuple[int, str]]:
    """Every ``unickpt`` name the code imports or reaches by attribute: ``(line, dotted name)``.
    ``module``: the code's own dotted module name (resolves relative imports)."""
    out: list[tuple[int, str]] = []
    roots: dict[str, str] = {}  # local name -> the unickpt module it is bound to by `import`
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "unickpt":
                    out.append((node.lineno, alias.name))
                    roots[alias.asname or "unickpt"] = alias.name if alias.asname else "unickpt"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                assert module is not None, "a relative import outside the package"
                package = module.split(".")[: -node.level]
                base = ".".join([*package, *([base] if base else [])])
            if base.split(".")[0] != "unickpt":
                continue
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            chain, inner = [], node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in roots:
                out.append((node.lineno, ".".join([roots[inner.id], *reversed(chain)])))
    return out


def _parse(code: str, where: str) -> ast.AST:
    tree = ast.parse(code, where)
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent  # type: ignore[attr-defined]
    return tree


def sources() -> list[tuple[str, ast.AST, str | None]]:
    """``(where, tree, module)`` for each integration module, example and doc code block."""
    out: list[tuple[str, ast.AST, str | None]] = []
    for path in sorted(glob.glob(os.path.join(SRC, "unickpt", "integrations", "*.py"))):
        rel = os.path.relpath(path, SRC)
        module = rel[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
        if path.endswith("__init__.py"):
            module += ".__init__"  # so that `from . import x` resolves inside the package
        out.append((rel, _parse(open(path).read(), rel), module))
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        out.append((rel, _parse(open(path).read(), rel), None))
    for pattern in ("README.md", "docs/guide/*.md"):
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            text, rel = open(path).read(), os.path.relpath(path, ROOT)
            for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M):
                where = f"{rel}:{text[: m.start()].count(chr(10)) + 1}"
                code = textwrap.dedent(m.group(2))
                try:
                    out.append((where, _parse(code, where), None))
                except SyntaxError:  # a signature listing, not code
                    assert "..." in code or "*," in code, where
    return out


def test_integrations_examples_and_doc_code_use_only_public_names() -> None:
    public = _public_names()
    assert "unickpt.LoadOptions" in public and "unickpt.engine" not in public  # the page is read as meant
    seen, bad = set(), []
    for where, tree, module in sources():
        for line, dotted in used_names(tree, module):
            if module and dotted.startswith(INTEGRATIONS + ".") and module.startswith(INTEGRATIONS):
                continue  # an integration's own modules
            if is_public(dotted, public):
                continue
            if module and (module, dotted) in INTERNAL_USES:
                seen.add((module, dotted))
                continue
            bad.append(f"{where}:{line}: {dotted}")
    assert not bad, "internal names (import the public one docs/api.md lists):\n" + "\n".join(bad)
    assert seen == set(INTERNAL_USES), f"no longer used, remove from INTERNAL_USES: {set(INTERNAL_USES) - seen}"


def test_the_check_tells_public_from_internal() -> None:
    public = _public_names()
    code = (
        "import unickpt\n"
        "from unickpt import save, LoadOptions\n"
        "from unickpt.options import RestoreOptions\n"
        "from unickpt.errors import IntegrityError\n"
        "from unickpt.storage import open_storage\n"
        "from unickpt.engine.runtime.worker import SaveHandle\n"
        "from unickpt.storage import local\n"
        "from unickpt.options import _member, METADATA_LIMIT\n"
        "def f():\n"
        "    from ..state.items import PerRank\n"
        "    return unickpt.SaveHandle.wait, unickpt.format.records.METADATA_FILE, unickpt.transforms.split_rows\n"
    )
    verdicts = {d: is_public(d, public) for _, d in used_names(_parse(code, "t"), "unickpt.integrations.x")}
    assert verdicts == {
        "unickpt": True,
        "unickpt.save": True,
        "unickpt.LoadOptions": True,
        "unickpt.options.RestoreOptions": True,
        "unickpt.errors.IntegrityError": True,
        "unickpt.storage.open_storage": True,
        "unickpt.engine.runtime.worker.SaveHandle": False,  # public as unickpt.SaveHandle only
        "unickpt.storage.local": False,  # a submodule of a public package
        "unickpt.options._member": False,
        "unickpt.options.METADATA_LIMIT": False,  # bound there, not in its __all__
        "unickpt.state.items.PerRank": False,  # relative, inside a function
        "unickpt.SaveHandle.wait": True,
        "unickpt.format.records.METADATA_FILE": False,
        "unickpt.transforms.split_rows": True,
    }
