"""Package boundaries (issue 11): test oracles live in ``tests/support`` and import nothing from
unickpt; no test computes its reference state with shipped code (``testing.toy.full_state`` is
gone); one launcher (``unickpt.testing.launch``) for tests and benchmarks, never pickle.

Its tests that start processes are in ``tests/integration/test_boundaries_processes.py``."""

from __future__ import annotations

import ast
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/unit/ -> the root
TESTS = os.path.join(ROOT, "tests")


def _py_files(*folders: str) -> list[str]:
    out = []
    for folder in folders:
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, folder)):
            out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return sorted(out)


@functools.cache  # the tests below scan the same files: each is parsed once per session
def _imports(path: str) -> tuple[tuple[str, str], ...]:
    """(module, name) for every import in ``path`` (name "" for ``import module``)."""
    out: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(node.module or "", a.name) for a in node.names]
    return tuple(out)


def test_issue11_boundaries_test_oracles_import_nothing_from_unickpt():
    files = _py_files("tests/support")
    assert any(f.endswith("reference.py") for f in files)
    # the save planner's oracle returns the library's plan records and refusals, so that plans and
    # errors compare equal: it may take those types, the dtype size table and the two refusal
    # wordings, never a planning rule
    record_types = {"unickpt.errors", "unickpt.planning.save.model", "unickpt.planning.specs"}
    allowed = {"save_oracle.py": record_types | {"unickpt.format.dtypes", "unickpt.format.validation"}}
    for path in files:
        ok = allowed.get(os.path.basename(path), set())
        bad = [m for m, _ in _imports(path) if (m == "unickpt" or m.startswith("unickpt.")) and m not in ok]
        assert not bad, (path, bad)


def test_issue11_boundaries_no_test_takes_its_reference_from_shipped_code():
    """The full-state oracle and the fqn cleaning it used are code under test: no test or
    benchmark imports them as a reference, and the shipped toy module no longer offers an oracle.
    The one module whose subject *is* ``clean_fqn`` may import it: it checks its output against
    the names of an unwrapped model, never against unickpt."""
    from unickpt.testing import toy

    assert not hasattr(toy, "full_state")
    subject_of = {"test_fsdp_internals.py": {"clean_fqn"}, "test_fsdp_internals_processes.py": {"clean_fqn"}}
    for path in _py_files("tests", "bench"):
        allowed = subject_of.get(os.path.basename(path), set())
        bad = [(m, n) for m, n in _imports(path) if m.startswith("unickpt") and n in ("full_state", "clean_fqn")]
        bad = [(m, n) for m, n in bad if n not in allowed]
        assert not bad, (path, bad)


def test_issue11_boundaries_test_plumbing_never_pickles():
    """The launcher and the test harnesses move results in the safe value encoding; only the
    tests that build hostile pickles on purpose (to prove unickpt never unpickles them) and the
    tests of the error transport between ranks import pickle."""
    deliberate = {
        os.path.join(TESTS, "reliability", "test_rel_hostile.py"),
        os.path.join(TESTS, "unit", "coordination", "test_outcomes.py"),
        # a hostile DCP .metadata pickle, refused unrun; hand-written pickles that try to set attributes
        os.path.join(TESTS, "integration", "tools", "test_tools_convert.py"),
        os.path.join(TESTS, "unit", "ops", "test_convert_hostile.py"),
        # hand-written pickles: expanded views, numpy arrays without their bytes, colliding keys (refused unrun)
        os.path.join(TESTS, "unit", "ops", "test_convert_bounds.py"),
        # verl's own torch.save rank files with a pickle that carries code, refused unrun
        os.path.join(TESTS, "integration", "integrations", "test_verl.py"),
    }
    for path in [*_py_files("tests", "bench"), os.path.join(ROOT, "src", "unickpt", "testing", "launch.py")]:
        if path in deliberate:
            continue
        mods = {m for m, _ in _imports(path)}
        assert not mods & {"pickle", "cloudpickle", "dill"}, path
