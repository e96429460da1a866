"""Ctrl-C (a real SIGINT) during a blocking ``unickpt.save`` on 2 gloo ranks (issue 39, item 10).

The documented behaviour (``engine.runtime.interrupts``, docs/guide/usage.md): the call keeps
running until the save is committed or failed on every rank, then raises ``KeyboardInterrupt``;
so when the exception arrives the folder's state is decided, and nothing changes afterwards.
"""

from __future__ import annotations

import os

import torch

import unickpt
from tests.workers.harness import run_ranks
from tests.workers.interrupt_workers import committed_id, interrupted_saves
from tests.workers.rel_helpers import mismatches, snapshot, tiny_model

# (name, the phases of the second save at which each rank gets a SIGINT (its own event), the
# application's own SIGINT handler?, the rank whose data writes fail (ENOSPC): the save fails)
CASES = [
    ("both-ranks-while-writing", {"0": ["save.write.file"], "1": ["save.write.file"]}, False, None),
    ("rank1-before-commit", {"1": ["save.commit.begin"]}, False, None),
    ("rank0-while-describing", {"0": ["save.serialize"]}, False, None),  # main thread, before any collective
    ("rank0-twice", {"0": ["save.serialize", "save.commit.begin"]}, False, None),  # a 2nd Ctrl-C while deferred
    ("rank0-save-fails-on-rank1", {"0": ["save.serialize"]}, False, 1),
    # the application's handler raises KeyboardInterrupt while the call waits for the commit
    ("own-handler-both-ranks-while-writing", {"0": ["save.write.file"], "1": ["save.write.file"]}, True, None),
]


def _loaded(path: str) -> dict[str, torch.Tensor]:
    model, optim = tiny_model(seed=77)
    unickpt.load(path, {"model": model, "optimizer": optim}, framework="torch")
    return snapshot(model, optim)


def test_issue39_item10_ctrl_c_during_blocking_save_decides_before_raising(tmp_path) -> None:
    root = str(tmp_path)
    cases = [{"name": n, "signals": s, "own_handler": o, "fail_rank": f} for n, s, o, f in CASES]
    per_rank = run_ranks(interrupted_saves, 2, root, cases)
    # the ranks have exited: their background workers (and the exit drain) have run to the end
    for i, (name, signals, own, fail_rank) in enumerate(CASES):
        path = os.path.join(root, name)
        final = committed_id(path)
        commits = fail_rank is None
        for rank, results in enumerate(per_rank):
            got = results[i]
            assert got["left"] == [], (name, rank, got)  # every planned signal was sent
            if str(rank) in signals:
                assert got["raised"] == "KeyboardInterrupt", (name, rank, got["handler_at_kill"], got)
                if not commits:
                    assert "which failed first" in got["message"] and got["cause"], (name, rank, got)
                else:  # deferred (unickpt's handler) / re-raised after the wait (the application's)
                    said = "which committed first" if own else "which was committed first"
                    assert said in got["message"], (name, rank, got)
            else:
                assert got["raised"] == ("nothing" if commits else "CheckpointError"), (name, rank, got)
            # the folder's state was decided when the call raised or returned: no later commit
            assert got["seen"] == final, (name, rank, got, final)
            assert (got["seen"] != got["first"]) is commits, (name, rank, got)
        ref = torch.load(f"{path}.{'second' if commits else 'first'}.pt", weights_only=True)
        assert not mismatches(_loaded(path), ref), name  # bit-exact: the committed state
        assert mismatches(torch.load(f"{path}.first.pt", weights_only=True), torch.load(f"{path}.second.pt"))
