"""The public surface and the layering of ``src/unickpt`` (issue 29, items 5 and 6).

- every dotted name of docs/api.md resolves, and the page lists every top-level name and every
  error class;
- the modules of ``src/unickpt`` import each other without a cycle at import time (module-level
  imports; imports inside functions and under ``if TYPE_CHECKING:`` do not run then);
- the layers: only ``cli`` (and ``tiering``, for ``ops.verify``) imports ``ops``; nothing imports
  ``cli`` but its entry points; nothing in the library imports ``testing``;
- the resize policies are enums that still take their strings.
"""

from __future__ import annotations

import ast
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")
PKG = os.path.join(SRC, "unickpt")
API_MD = os.path.join(ROOT, "docs", "api.md")


# --------------------------------------------------------------------------------- docs/api.md


def _api_names() -> list[str]:
    text = open(API_MD, encoding="utf-8").read()
    return sorted(set(re.findall(r"`(unickpt(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text)))


def _module_file(dotted: str) -> str | None:
    base = os.path.join(SRC, *dotted.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _defines(path: str, name: str) -> bool:
    """Whether the module at ``path`` defines ``name`` at top level (read, not imported)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names: attributes first, submodules where no attribute is."""
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def test_issue29_every_name_of_the_api_page_resolves() -> None:
    names = _api_names()
    assert len(names) > 80, names  # the page is read: the table rows count
    for dotted in names:
        if dotted.startswith("unickpt.integrations."):  # needs its framework: read, not imported
            module, _, name = dotted.rpartition(".")
            path = _module_file(dotted) or _module_file(module)
            assert path is not None, dotted
            assert _module_file(dotted) is not None or _defines(path, name), dotted
            continue
        _resolve(dotted)  # raises on a stale name


def test_issue29_the_api_page_lists_every_top_level_name_and_error() -> None:
    import unickpt
    from unickpt import errors

    listed = set(_api_names())
    missing = [n for n in unickpt.__all__ if not {f"unickpt.{n}", f"unickpt.errors.{n}"} & listed]
    missing += [n for n in errors.__all__ if f"unickpt.errors.{n}" not in listed]
    assert not missing, missing


def test_issue29_top_level_names_are_those_of_before() -> None:
    """The restructure removed no top-level name (the list of 2026-11-27)."""
    import unickpt

    before = """transforms save load wait_all Checkpointer default_checkpointer SaveHandle SaveOptions LoadOptions
    StorageOptions CoordinationOptions rng_state set_rng_state PerRank CheckpointError ChecksumMismatchError
    ConcurrentSaveError CorruptMetadataError DtypeMismatchError FrameworkError IncompleteCheckpointError
    MissingDataFileError MissingKeysError NotACheckpointError NoProcessGroupError UnsafeNameError PlanningError
    LoaderStateError ExtraStateResizeError RankFailures ShapeMismatchError SnapshotConflictError StorageError
    TruncatedDataFileError UnexpectedKeysError UnsupportedFormatVersionError CheckpointManager
    TieredCheckpointManager FlatTensors data TransientStorageError UnsupportedValueError RankDisagreementError
    CollectiveError CollectiveTimeoutError RemoteRankError AsyncSaveFailures SaveLockLostError ForeignFolderError
    UnsafePathError SizeLimitError MissingDependencyError""".split()
    assert set(before) <= set(unickpt.__all__)  # names may be added (issue 30: export_hf, HFExport)
    for name in before:
        assert getattr(unickpt, name) is not None, name


# ------------------------------------------------------------------------------- import graph


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, SRC)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], top_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``body``: at import time only (``top_level``: not inside
    functions, not under ``if TYPE_CHECKING:``), or all of them."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and top_level:
            continue
        elif isinstance(node, ast.If) and top_level and _is_type_checking(node.test):
            out += _import_nodes(node.orelse, top_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    out += _import_nodes([n for n in inner if isinstance(n, ast.AST)], top_level)  # type: ignore[misc]
    return out


def _targets(module: str, path: str, node: ast.Import | ast.ImportFrom, modules: dict[str, str]) -> set[str]:
    """The unickpt modules an import statement of ``module`` makes Python execute by name."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if node.level:
        package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
        base = package[: len(package) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = set()
    for a in node.names:
        sub = f"{source}.{a.name}"
        if sub in modules:
            out.add(sub)
        elif source in modules:
            out.add(source)
    return out


def _graph(top_level: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        edges: set[str] = set()
        for node in _import_nodes(tree.body, top_level):
            edges |= _targets(module, path, node, modules)
        graph[module] = edges - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_issue29_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_issue29_no_import_cycle_at_import_time() -> None:
    graph = _graph(top_level=True)
    assert len(graph) > 100 and "unickpt.ops.inspect" in graph["unickpt.cli.checkpoint"] | graph["unickpt.ops.diff"]
    assert not _cycles(graph), _cycles(graph)


def test_issue29_layers_ops_cli_testing() -> None:
    """Every import, at any level: ``ops`` is used by ``cli``, ``tiering`` and the integrations only
    (these are library users: test_private_imports holds them to the names docs/api.md lists),
    ``cli`` by its entry points, ``testing`` by nothing in the library; ``ops.verify`` imports no
    other op."""
    graph = _graph(top_level=False)
    may_import = {
        "unickpt.ops": ("unickpt.ops", "unickpt.cli", "unickpt.tiering", "unickpt.integrations"),
        "unickpt.cli": ("unickpt.cli", "unickpt.__main__"),
        "unickpt.testing": ("unickpt.testing",),
    }
    bad = []
    for module, edges in graph.items():
        for target in edges:
            for layer, allowed in may_import.items():
                inside = target == layer or target.startswith(layer + ".")
                if inside and not any(module == a or module.startswith(a + ".") for a in allowed):
                    bad.append((module, target))
    assert not bad, bad
    assert not {t for t in graph["unickpt.ops.verify"] if t.startswith("unickpt.ops.")}
    assert graph["unickpt.tiering"] & {"unickpt.ops.verify"}


def test_issue29_tools_package_is_gone_and_entry_points_work() -> None:
    import unickpt.cli
    import unickpt.cli.__main__

    assert not os.path.exists(os.path.join(PKG, "tools"))
    assert callable(unickpt.cli.main) and unickpt.cli.EXIT_USAGE == 2
    with pytest.raises(SystemExit) as exit_:
        unickpt.cli.main(["--version"])
    assert exit_.value.code == 0


# ------------------------------------------------------------------------------------- options


def test_issue29_resize_policies_are_enums_that_take_their_strings() -> None:
    from unickpt import LoadOptions
    from unickpt.options import ExtraStateOnResize, LoaderOnResize, RestoreOptions

    assert [m.value for m in ExtraStateOnResize] == ["modulo", "rank0", "error", "skip"]
    assert [m.value for m in LoaderOnResize] == ["error", "skip"]
    default = LoadOptions().restore
    assert default.extra_state_on_resize is ExtraStateOnResize.MODULO and default.extra_state_on_resize == "modulo"
    assert default.loader_on_resize is LoaderOnResize.ERROR and default.loader_on_resize == "error"
    for text in ("modulo", "rank0", "error", "skip"):
        by_text = RestoreOptions(extra_state_on_resize=text)
        assert by_text.extra_state_on_resize is ExtraStateOnResize(text)
        assert by_text == RestoreOptions(extra_state_on_resize=ExtraStateOnResize(text))
    assert RestoreOptions(loader_on_resize="skip").loader_on_resize is LoaderOnResize.SKIP
    for bad in ("MODULO", "", None, 0, ["modulo"]):
        with pytest.raises(ValueError, match="extra_state_on_resize must be modulo, rank0, error or skip"):
            RestoreOptions(extra_state_on_resize=bad)  # type: ignore[arg-type]
    for bad in ("modulo", "Skip", None, ExtraStateOnResize.RANK0):
        with pytest.raises(ValueError, match="loader_on_resize must be 'error' or 'skip'"):
            RestoreOptions(loader_on_resize=bad)  # type: ignore[arg-type]
