"""Issue 41 item 1: ``storage/`` is the one layer that writes local files.

Outside ``src/unickpt/storage`` no module opens a file for writing, writes or truncates through a
descriptor, renames, links, unlinks, makes or removes a folder, or fsyncs: the checkpoint's files
go through a ``Storage``, the Hugging Face export and the output folders of ``merge`` /
``convert`` through ``storage.local_files`` (exclusive create, no link followed, fsync, rename
relative to a folder descriptor). The scan reads the AST of every module under ``src/unickpt``;
``ALLOWED`` lists the few modules that write their own files, each call by name with its reason.
"""

from __future__ import annotations

import ast
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/unit/ -> the root
SRC = os.path.join(ROOT, "src")
PACKAGE = os.path.join(SRC, "unickpt")
LAYER = "unickpt.storage"

# module.function calls that write, rename, link, unlink, make/remove folders or fsync
_OS = {
    "rename", "renames", "replace", "link", "symlink", "unlink", "remove", "removedirs", "rmdir", "mkdir",
    "makedirs", "mkfifo", "mknod", "fsync", "fdatasync", "write", "pwrite", "pwritev", "writev", "ftruncate",
    "truncate", "posix_fallocate", "copy_file_range", "sendfile",
}  # fmt: skip
_SHUTIL = {"copy", "copy2", "copyfile", "copytree", "move", "rmtree"}
_TEMPFILE = {"mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile", "TemporaryDirectory"}
_BANNED = {"os": _OS, "shutil": _SHUTIL, "tempfile": _TEMPFILE}
# methods that only pathlib paths have: banned whatever the receiver
_PATH_METHODS = {"write_text", "write_bytes", "touch", "symlink_to", "hardlink_to"}
# os.open flags that make it an open for writing (creating, truncating)
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND", "O_EXCL", "O_TMPFILE"}

# module -> (calls it may make, why). Each entry is a module writing its own files, not a
# checkpoint's or an export's; keep this list short.
ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    "unickpt.cli.report": (frozenset({"open"}), "the CLI writes the trace file its user named (--trace)"),
    "unickpt.cli": (frozenset({"os.open"}), "the CLI points stdout at /dev/null when its reader went away"),
    "unickpt.monitoring.sinks": (
        frozenset({"os.makedirs", "open"}),
        "the JSONL event sink appends to its own per-rank log files",
    ),
    "unickpt.engine.runtime.interrupts": (
        frozenset({"os.write"}),
        "the deferred Ctrl-C notice goes to fd 2 (stderr) from a signal handler, no file",
    ),
    "unickpt.engine.save.writer_process": (
        frozenset({"os.ftruncate"}),
        "sizes the anonymous shared memory (memfd) of a snapshot image, no file on disk",
    ),
    "unickpt.testing.launch": (
        frozenset({"open", "os.replace", "os.mkdir", "shutil.rmtree", "tempfile.mkdtemp"}),
        "the test and benchmark launcher's own report files in its temporary folder",
    ),
    "unickpt.integrations.verl": (
        frozenset({"os.remove", "os.rmdir", "os.makedirs", "tempfile.TemporaryDirectory"}),
        "verl's own Hugging Face folder beside the checkpoint: the files verl's saver wrote, staged "
        "in a temporary folder and deleted with the checkpoint (only the names it recorded)",
    ),
    "unickpt.integrations.lightning": (
        frozenset({"os.unlink"}),
        "Lightning's remove_checkpoint of a single-file path Lightning itself named",
    ),
    "unickpt.integrations._delete": (
        frozenset({"os.rmdir"}),
        "removes a checkpoint folder once delete_checkpoint left it empty (never a non-empty one)",
    ),
    "unickpt.integrations.accelerate": (
        frozenset({"os.makedirs"}),
        "creates accelerate's project_dir/checkpoints folder, as accelerate's own save_state does",
    ),
}


def _modules() -> list[tuple[str, str]]:
    """(dotted name, path) of every module under src/unickpt."""
    out = []
    for dirpath, _dirs, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, SRC)[: -len(".py")].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out.append((".".join(rel), path))
    return sorted(out)


@functools.cache
def _tree(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


def _path_of(module: str) -> str | None:
    base = os.path.join(SRC, *module.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(p):
            return p
    return None


def _resolve_module(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    is_package = _path_of(module) is not None and _path_of(module).endswith("__init__.py")  # type: ignore[union-attr]
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _assigned(tree: ast.Module) -> dict[str, list[ast.expr]]:
    """Every value assigned to each plain name anywhere in the module."""
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out.setdefault(node.target.id, []).append(node.value)
    return out


def _imported_names(module: str, tree: ast.Module) -> dict[str, tuple[str, str]]:
    """local name -> (module, name) for every ``from module import name``."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve_module(module, node)
            for a in node.names:
                out[a.asname or a.name] = (src, a.name)
    return out


def _flags(module: str, expr: ast.expr, depth: int = 0) -> set[str] | None:
    """The ``O_*`` names an ``os.open`` flags expression can hold (names resolved through the
    module's assignments and its ``from ... import``s); None when it cannot be told."""
    if depth > 8:
        return None
    if isinstance(expr, ast.Attribute) and expr.attr.startswith("O_"):
        return {expr.attr}
    if isinstance(expr, ast.Constant) and isinstance(expr.value, int):
        return set()
    if isinstance(expr, ast.BinOp):
        left, right = _flags(module, expr.left, depth + 1), _flags(module, expr.right, depth + 1)
        return None if left is None or right is None else left | right
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr":
        if len(expr.args) >= 2 and isinstance(expr.args[1], ast.Constant) and str(expr.args[1].value).startswith("O_"):
            return {str(expr.args[1].value)}
        return None
    if isinstance(expr, ast.Name):
        path = _path_of(module)
        tree = _tree(path) if path else None
        if tree is None:
            return None
        values = _assigned(tree).get(expr.id)
        if values:
            found: set[str] = set()
            for v in values:
                got = _flags(module, v, depth + 1)
                if got is None:
                    return None
                found |= got
            return found
        origin = _imported_names(module, tree).get(expr.id)
        if origin is not None and origin[0].startswith("unickpt"):
            return _flags(origin[0], ast.Name(origin[1]), depth + 1)
        if expr.id.startswith("O_") and origin is not None and origin[0] == "os":
            return {expr.id}
    return None


def _writes_by_mode(call: ast.Call, position: int) -> bool:
    """Whether an ``open``-like call's mode (argument ``position`` or ``mode=``) writes; a mode
    that is not a literal counts as writing."""
    mode: ast.expr | None = call.args[position] if len(call.args) > position else None
    for kw in call.keywords:
        if kw.arg == "mode":
            mode = kw.value
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True


def file_writes(module: str, source: str | None = None) -> list[tuple[int, str]]:
    """(line, call) of every call in ``module`` (its file, or ``source``) that writes, renames,
    links, unlinks, makes or removes a folder, or fsyncs (module docstring)."""
    if source is not None:
        tree = ast.parse(source)
    else:
        path = _path_of(module)
        assert path is not None, module
        tree = _tree(path)
    aliases: dict[str, str] = {}  # local name -> "os" / "shutil" / "tempfile" / "io" / "os.<fn>"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in (*_BANNED, "io"):
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module in (*_BANNED, "io"):
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in aliases:
            name = f"{aliases[func.value.id]}.{func.attr}"
        elif isinstance(func, ast.Name) and func.id in aliases and "." in aliases[func.id]:
            name = aliases[func.id]
        elif isinstance(func, ast.Name) and func.id == "open":
            name = "open"
        elif isinstance(func, ast.Attribute) and func.attr in _PATH_METHODS:
            found.append((node.lineno, f".{func.attr}"))
            continue
        if name is None:
            continue
        lib, _, fn = name.partition(".")
        if name in ("open", "io.open"):
            if _writes_by_mode(node, 1):
                found.append((node.lineno, "open"))
        elif name == "os.fdopen":
            if _writes_by_mode(node, 1):
                found.append((node.lineno, name))
        elif name == "os.open":
            flags = _flags(module, node.args[1]) if len(node.args) > 1 else set()
            if flags is None or flags & _WRITE_FLAGS:
                found.append((node.lineno, name))
        elif fn in _BANNED.get(lib, ()):
            found.append((node.lineno, name))
    return sorted(found)


def _allowed(module: str, call: str) -> bool:
    for owner, (calls, _why) in ALLOWED.items():
        if module == owner or module.startswith(owner + "."):
            if "*" in calls or call in calls:
                return True
    return False


def test_issue41_item1_outside_storage_no_module_writes_renames_links_unlinks_or_fsyncs_files():
    """Every write-side file call in src/unickpt is in ``storage/`` or an ``ALLOWED`` one."""
    bad = []
    for module, _path in _modules():
        if module == LAYER or module.startswith(LAYER + "."):
            continue
        bad += [f"{module}:{line} {call}" for line, call in file_writes(module) if not _allowed(module, call)]
    assert not bad, "write through unickpt.storage.local_files (or a Storage) instead:\n" + "\n".join(bad)


def test_issue41_item1_every_allowed_exception_is_still_needed():
    """An ``ALLOWED`` entry (a call by name) that its module no longer makes is removed, so the
    list stays the short list of what really writes outside ``storage/``."""
    unused = []
    for owner, (calls, _why) in ALLOWED.items():
        made = {c for m, _p in _modules() if m == owner or m.startswith(owner + ".") for _l, c in file_writes(m)}
        unused += [f"{owner} {c}" for c in calls - {"*"} if c not in made]
    assert not unused, unused


def test_issue41_item1_the_scan_catches_each_kind_of_file_write():
    """The scanner itself: an ``os.rename`` added to ``ops/`` (and every other kind of write,
    under any import spelling) is found; reads are not."""
    writes = {
        "import os\nos.rename('a', 'b')\n": "os.rename",
        "import os as o\no.replace('a', 'b')\n": "os.replace",
        "from os import link\nlink('a', 'b')\n": "os.link",
        "import os\nos.fsync(3)\n": "os.fsync",
        "import os\nos.unlink('a')\n": "os.unlink",
        "import os\nos.pwrite(3, b'x', 0)\n": "os.pwrite",
        "import os\nfd = os.open('a', os.O_WRONLY | os.O_CREAT)\n": "os.open",
        "import os\nFLAGS = os.O_RDWR\nos.open('a', FLAGS)\n": "os.open",
        "import os\ndef f(flags):\n    return os.open('a', flags)\n": "os.open",  # flags unknown
        "with open('a', 'wb') as f:\n    pass\n": "open",
        "with open('a', mode='a') as f:\n    pass\n": "open",
        "import os\nf = os.fdopen(3, 'wb')\n": "os.fdopen",
        "import shutil\nshutil.rmtree('a')\n": "shutil.rmtree",
        "import pathlib\npathlib.Path('a').write_bytes(b'')\n": ".write_bytes",
        "import tempfile\ntempfile.mkstemp()\n": "tempfile.mkstemp",
    }
    for source, call in writes.items():
        assert [c for _, c in file_writes("unickpt.ops.merge", source)] == [call], source
        assert not _allowed("unickpt.ops.merge", call), call
    reads = [
        "with open('a', 'rb') as f:\n    pass\n",
        "with open('a') as f:\n    pass\n",
        "import os\nos.open('a', os.O_RDONLY | os.O_NOFOLLOW | getattr(os, 'O_CLOEXEC', 0))\n",
        "import os\nos.fstat(3)\nos.listdir('.')\n",
        "'a'.replace('b', 'c')\n",
    ]
    for source in reads:
        assert file_writes("unickpt.ops.merge", source) == [], source
