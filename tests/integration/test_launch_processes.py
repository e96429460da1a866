"""The test harness's ranks (``tests.workers.harness``, over ``unickpt.testing.launch`` with
``preload``): forked from a fork server that imported ``PRELOAD`` once, each rank still gets the
environment of the test at the time of its call (not the server's, fixed when it started)."""

from __future__ import annotations

import signal

from tests.workers.harness import PRELOAD, launch_ranks, run_ranks
from tests.workers.launch_workers import abort_on_a_thread, environment_and_modules

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


def test_issue39_item27_a_rank_killed_by_sigabrt_leaves_every_threads_python_stack(tmp_path):
    # item 27's only clue was glibc's one line before SIGABRT: a rank that dies by a fatal signal
    # must also say where each of its threads was (faulthandler), and still die by that signal
    err = tmp_path / "rank0.err"
    (outcome,) = launch_ranks(abort_on_a_thread, 1, str(err), victim=0)
    assert outcome.exitcode == -signal.SIGABRT, outcome
    text = err.read_text(errors="replace")
    assert "Fatal Python error: Aborted" in text, text
    assert "in heap_check_fails_here" in text, text  # the aborting thread's frame
    assert "in abort_on_a_thread" in text, text  # and the main thread, waiting in the rank function
