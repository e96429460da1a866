"""Suite-wide hooks. ``tests`` is a package and the repository root is on ``sys.path``
(``pythonpath`` in pyproject.toml), so test files, spawned ranks (``spawn`` copies ``sys.path``
into the child) and subprocesses given that path import ``tests.workers.<name>`` (rank functions,
the spawn harness), ``tests.fixtures.<name>`` and ``tests.support.<name>`` (oracles).

The test tiers: every test is marked ``distributed`` / ``slow`` by ``tests/tiers.py``, and a test
not marked ``distributed`` that starts a process fails."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.azurite import az_container, azurite_server  # fixtures: Azurite per test process
from tests.fixtures.gcsserver import gcs_bucket, gcs_server  # fixtures: a real GCS emulator per test process
from tests.fixtures.s3server import s3_bucket, s3_server  # fixtures: a real SeaweedFS server per test process
from tests.support import hypothesis_profiles
from tests.tiers import markers_for

__all__ = ["az_container", "azurite_server", "gcs_bucket", "gcs_server", "s3_bucket", "s3_server"]

# Hypothesis profiles `ci` (default, `make test`) and `fast` (`make test-fast`): before any test
# module is imported, so module-level `settings(max_examples=examples(n))` read the loaded one.
hypothesis_profiles.register()

# --- tiers: markers and the process guard (rules in tests/tiers.py) -------------------------

_TESTS_ROOT = Path(__file__).resolve().parent
_running_unmarked: str | None = None  # node id of the running test while it may not start processes

# Opt-in record of what each test costs in processes: with UNICKPT_TEST_PROCESS_LOG=<file>, one
# tab-separated line per test (node id, processes started, subprocesses started, seconds) is
# appended to <file> (how the suite's spawn counts are measured; off by default).
_PROCESS_LOG = os.environ.get("UNICKPT_TEST_PROCESS_LOG")
_started = {"processes": 0, "subprocesses": 0}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test ``distributed`` / ``slow`` by its folder and file (``tests/tiers.py``)."""
    for item in items:
        try:
            parts = item.path.resolve().relative_to(_TESTS_ROOT).parts
        except ValueError:
            continue
        name = getattr(item, "originalname", item.name)
        for marker in sorted(markers_for(parts, name)):
            item.add_marker(marker)


def _refuse_unmarked(what: str) -> None:
    if _running_unmarked is not None:
        raise RuntimeError(
            f"{_running_unmarked} starts {what} but is not marked 'distributed': name it in "
            "tests/tiers.py (or move it to tests/integration/), so the fast tier starts no process"
        )


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _guarded_popen_init(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
    _refuse_unmarked("a subprocess")
    _started["subprocesses"] += 1
    _popen_init(self, *args, **kwargs)


def _guarded_process_start(self: multiprocessing.process.BaseProcess) -> None:
    _refuse_unmarked("a multiprocessing process")
    _started["processes"] += 1
    _process_start(self)


subprocess.Popen.__init__ = _guarded_popen_init  # type: ignore[method-assign]
multiprocessing.process.BaseProcess.start = _guarded_process_start  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """While a test not marked ``distributed`` runs (set-up, call, tear-down), starting a
    process fails it."""
    global _running_unmarked
    _running_unmarked = None if item.get_closest_marker("distributed") else item.nodeid
    _started.update(processes=0, subprocesses=0)
    t0 = time.monotonic()
    try:
        yield
    finally:
        _running_unmarked = None
        if _PROCESS_LOG:
            with open(_PROCESS_LOG, "a") as log:
                seconds = time.monotonic() - t0
                log.write(f"{item.nodeid}\t{_started['processes']}\t{_started['subprocesses']}\t{seconds:.1f}\n")
