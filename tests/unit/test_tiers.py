"""Every test that starts a process is marked ``distributed`` (so ``make test-fast`` starts none),
read from the test files' source: a test function starts processes when it, or a function or
fixture of its file it reaches, names the spawn harness, ``subprocess``, ``multiprocessing`` or
the S3 server fixtures. ``tests/conftest.py`` enforces the same at run time."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.tiers import DISTRIBUTED_TESTS, markers_for

TESTS = Path(__file__).resolve().parent
while TESTS.name != "tests":
    TESTS = TESTS.parent

# names whose use means a process is started: the spawn harness, the standard library's
# process modules, the fixtures that start an S3 server
PROCESS_NAMES = frozenset(
    {
        "run_ranks",
        "launch_ranks",
        "run_jobs",
        "subprocess",
        "Popen",
        "multiprocessing",
        "get_context",
        "s3_server",
        "s3_bucket",
    }
)


def _names_per_function(tree: ast.Module) -> dict[str, set[str]]:
    """Every function of the file (methods included, by name) -> the names it uses."""
    names: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            used = names.setdefault(node.name, set())
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name):
                    used.add(sub.id)
                elif isinstance(sub, ast.Attribute):
                    used.add(sub.attr)
                elif isinstance(sub, ast.arg):
                    used.add(sub.arg)
    return names


def process_tests(source: str) -> set[str]:
    """The test functions of a file that start processes (directly or through the file's helpers
    and fixtures)."""
    names = _names_per_function(ast.parse(source))
    starts: dict[str, bool] = {}

    def reaches(fn: str, path: frozenset[str]) -> bool:
        if fn not in starts:
            starts[fn] = bool(names[fn] & PROCESS_NAMES) or any(
                reaches(g, path | {fn}) for g in names[fn] if g in names and g not in path and g != fn
            )
        return starts[fn]

    return {fn for fn in names if fn.startswith("test_") and reaches(fn, frozenset())}


def test_the_detector_sees_direct_helper_and_fixture_process_starts() -> None:
    source = (
        "import subprocess\n"
        "def _helper():\n    subprocess.run(['true'])\n"
        "def test_direct():\n    run_ranks(f, 2)\n"
        "def test_through_helper():\n    _helper()\n"
        "def test_s3(s3_bucket):\n    pass\n"
        "def test_plain():\n    assert 1 + 1 == 2\n"
    )
    assert process_tests(source) == {"test_direct", "test_through_helper", "test_s3"}


def test_every_test_that_starts_processes_is_marked_distributed() -> None:
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        parts = path.relative_to(TESTS).parts
        for name in sorted(process_tests(path.read_text())):
            if "distributed" not in markers_for(parts, name):
                unmarked.append(f"{'/'.join(parts)}::{name}")
    assert not unmarked, "start processes but are not marked distributed (tests/tiers.py):\n" + "\n".join(unmarked)


def test_the_tier_table_names_only_existing_files_and_tests() -> None:
    files = {p.name: p for p in TESTS.rglob("test_*.py")}
    stale = []
    for name, tests in DISTRIBUTED_TESTS.items():
        if name not in files:
            stale.append(name)
        elif tests is not None:
            defined = set(_names_per_function(ast.parse(files[name].read_text())))
            stale.extend(f"{name}::{t}" for t in sorted(tests - defined))
    assert not stale, f"tests/tiers.py names what does not exist: {stale}"


def test_test_file_names_are_unique_and_the_unit_tier_holds_no_process_test() -> None:
    paths = list(TESTS.rglob("test_*.py"))
    names = [p.name for p in paths]
    assert len(names) == len(set(names)), "test file names must be unique (tests/tiers.py keys them by name)"
    misplaced = [
        str(p.relative_to(TESTS))
        for p in paths
        if p.relative_to(TESTS).parts[0] == "unit" and p.name in DISTRIBUTED_TESTS
    ]
    assert not misplaced, f"process tests belong in tests/integration/<area>/: {misplaced}"
