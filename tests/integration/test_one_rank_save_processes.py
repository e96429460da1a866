"""Issue 39 item 25 (docs/migrating.md, "A save called on one rank only"): a ``unickpt.save``
called on rank 0 only, the ``if rank == 0: torch.save(...)`` habit, fails with
``CollectiveTimeoutError`` naming the rank that never came once ``SaveOptions(timeout=...)`` has
passed, instead of after the job's (torch's 30-minute) timeout; nothing is committed."""

from __future__ import annotations

import os

from tests.workers.harness import run_ranks
from tests.workers.one_rank_save_workers import save_on_rank0_only
from unickpt.format.records import METADATA_FILE


def test_issue39_item25_save_on_one_rank_fails_after_save_options_timeout(tmp_path) -> None:
    path = str(tmp_path / "ck")
    rank0, _ = run_ranks(save_on_rank0_only, 2, path, 3.0, timeout=120)
    assert rank0["error"] == "CollectiveTimeoutError", rank0
    assert rank0["missing"] == [1], rank0
    assert "timeout" in rank0["text"].lower() or "within" in rank0["text"], rank0["text"]
    assert not os.path.exists(os.path.join(path, METADATA_FILE))
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "migrating.md")).read()
    assert "SaveOptions(timeout=" in text and "on one rank only" in text  # what the docs recommend
