"""The test harness's ranks (``tests.workers.harness``, over ``unickpt.testing.launch`` with
``preload``): forked from a fork server that imported ``PRELOAD`` once, each rank still gets the
environment of the test at the time of its call (not the server's, fixed when it started)."""

from __future__ import annotations

from tests.workers.harness import PRELOAD, run_ranks
from tests.workers.launch_workers import environment_and_modules

GONE, NEW = "UNICKPT_TEST_LAUNCH_GONE", "UNICKPT_TEST_LAUNCH_NEW"


def test_ranks_start_with_the_preloaded_modules_and_the_callers_current_environment(monkeypatch):
    monkeypatch.setenv(GONE, "set before the first call")
    monkeypatch.delenv(NEW, raising=False)
    first = run_ranks(environment_and_modules, 2, [GONE, NEW], list(PRELOAD))  # starts the server if none runs
    assert [r["env"] for r in first] == [{GONE: "set before the first call", NEW: None}] * 2
    assert all(all(r["imported"].values()) for r in first), first
    monkeypatch.delenv(GONE)
    monkeypatch.setenv(NEW, "set after the server started")
    second = run_ranks(environment_and_modules, 2, [GONE, NEW], [])
    assert [r["env"] for r in second] == [{GONE: None, NEW: "set after the server started"}] * 2
    assert [r["world"] for r in second] == ["2", "2"]  # the launcher's own variables still apply
