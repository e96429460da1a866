"""The writer process of async saves (``SaveOptions(writer="process")``, engine.save.writer_process)
at world size 2: one spawn for every check (save + bit-exact load, a writer SIGKILLed mid-save,
restart, close)."""

from __future__ import annotations

import os

import pytest

from tests.workers.harness import run_ranks
from tests.workers.writer_process_workers import save_kill_close
from unickpt.engine.save.writer_process import supported

pytestmark = pytest.mark.skipif(not supported(), reason="the writer process needs Linux (memfd)")


def test_writer_process_saves_survives_a_killed_writer_and_closes(tmp_path):
    r0, r1 = run_ranks(save_kill_close, 2, str(tmp_path))
    for r in (r0, r1):
        assert r["writer_started"] and r["first_exact"] and r["writer_without_torch"]
        # the death of rank 1's writer fails the save on BOTH ranks, naming it
        assert r["kill_error"] is not None and "writer process" in r["kill_error"], r["kill_error"]
        assert r["killed_pid_was_writer"]
        assert r["previous_intact"]  # nothing committed: the first checkpoint loads as it was
        assert r["new_writer"] and r["third_exact"]
        assert r["data_kept_first"]
        assert r["closed_pid"] is None and r["process_gone"]
    assert "signal 9" in r1["kill_error"] and "SIGKILL" in r1["kill_error"]
    # the failed save left no data folder behind: only the new commit's was added
    assert len(r0["data_after"]) == 1, r0["data_after"]
    assert not os.path.exists(os.path.join(tmp_path, "ckpt", "data", "tmp"))
