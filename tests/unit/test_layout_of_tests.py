"""``tests/unit`` mirrors ``src/unickpt`` (issue 41, item 2): the tests of module
``src/unickpt/<package>/<module>.py`` live in ``tests/unit/<package>/test_<module>.py``, or in
``test_<module>_<aspect>.py`` when a module's tests are split by what they check. A module that
shares its name with another package's module may be prefixed with its package
(``storage/test_storage_registry.py``, ``frameworks/test_frameworks_registry.py``: test file names
are unique in ``tests/``, ``tests/tiers.py`` keys them by name); a private module is named without
its underscore (``frameworks/_fsdp_internals.py``: ``test_fsdp_internals.py``); a package's
``__init__`` is named by the package (``cli/test_cli.py``, ``monitoring/test_monitoring.py``).

The few files that test a behaviour through the public API rather than one module are listed in
``BEHAVIOUR`` with the reason; everything else is checked by name, so a module renamed in ``src/``
fails here until its tests follow it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC, UNIT = ROOT / "src" / "unickpt", ROOT / "tests" / "unit"

# test files (relative to tests/unit) that test one behaviour across modules, through ``unickpt``'s
# public API: no module of their folder's package is theirs alone
BEHAVIOUR = {
    "test_boundaries.py": "layering and the oracle rule over the whole tree",
    "test_careless_user.py": "what a careless user meets, from every entry point",
    "test_doc_examples.py": "the code blocks of docs/",
    "test_docs_names.py": "the dotted names docs/ mentions",
    "test_hypothesis_profiles.py": "the suite's Hypothesis profiles (tests/support)",
    "test_layering.py": "the allowed imports between the packages of src/unickpt",
    "test_layout_of_tests.py": "this rule",
    "test_local_file_boundary.py": "no module outside storage/ writes local files",
    "test_module_docstrings.py": "every module's docstring",
    "test_private_imports.py": "private torch names over the whole tree",
    "test_public_surface.py": "unickpt's public names",
    "test_resume_single.py": "resume semantics through unickpt.save / load",
    "test_tiers.py": "the test tiers (tests/tiers.py)",
    "frameworks/test_describe.py": "one description per adapter: every built-in framework, save and load",
    "frameworks/test_load_in_place.py": "the in-place load refusal, through unickpt.load",
    "state/test_state_kinds.py": "what a state may hold, through unickpt.save / load",
    "state/test_stateful_round_trip.py": "Stateful objects' round trip, through unickpt.save / load",
}


def _names(package: Path) -> set[str]:
    """What a test file of ``package``'s folder may be named after: its modules (without a leading
    underscore), its subpackages and the package itself."""
    names = {package.name} if package != SRC else set()
    for p in package.iterdir():
        if p.suffix == ".py" and p.stem != "__init__":
            names.add(p.stem.lstrip("_"))
        elif p.is_dir() and (p / "__init__.py").exists():
            names.add(p.name)
    return names


def _mirrors(stem: str, package: Path) -> bool:
    prefixes = ("", f"{package.name}_")
    return any(stem == p + n or stem.startswith(f"{p}{n}_") for n in _names(package) for p in prefixes)


def test_issue41_item2_unit_tests_mirror_the_modules_of_src() -> None:
    wrong = []
    for path in sorted(UNIT.rglob("test_*.py")):
        rel = path.relative_to(UNIT)
        if rel.as_posix() in BEHAVIOUR:
            continue
        package = SRC.joinpath(*rel.parts[:-1])
        if not (package / "__init__.py").exists():
            wrong.append(f"{rel}: src/unickpt/{rel.parent.as_posix()} is no package")
        elif not _mirrors(path.stem.removeprefix("test_"), package):
            wrong.append(f"{rel}: names no module of src/unickpt/{rel.parent.as_posix()}")
    assert not wrong, "\n".join(wrong)


def test_issue41_item2_every_listed_behaviour_file_exists() -> None:
    assert [name for name in BEHAVIOUR if not (UNIT / name).exists()] == []
