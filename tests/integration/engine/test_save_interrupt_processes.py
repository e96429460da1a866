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

# name -> the phases of the second save at which each rank gets a SIGINT (its own event)
CASES = {
    "both-ranks-while-writing": {"0": ["save.write.file"], "1": ["save.write.file"]},
    "rank1-before-commit": {"1": ["save.commit.begin"]},
    "rank0-while-describing": {"0": ["save.serialize"]},  # main thread, before the first collective
    "rank0-twice": {"0": ["save.serialize", "save.commit.begin"]},  # a second Ctrl-C while deferred
}
# the application's own SIGINT handler raises KeyboardInterrupt while the call waits for the commit
OWN_HANDLER = {"own-handler-both-ranks-while-writing": {"0": ["save.write.file"], "1": ["save.write.file"]}}


def _loaded(path: str) -> dict[str, torch.Tensor]:
    model, optim = tiny_model(seed=77)
    unickpt.load(path, {"model": model, "optimizer": optim}, framework="torch")
    return snapshot(model, optim)


def test_issue39_item10_ctrl_c_during_blocking_save_decides_before_raising(tmp_path) -> None:
    root = str(tmp_path)
    cases = [[name, phases, False] for name, phases in CASES.items()]
    cases += [[name, phases, True] for name, phases in OWN_HANDLER.items()]
    per_rank = run_ranks(interrupted_saves, 2, root, cases)
    # the ranks have exited: their background workers (and the exit drain) have run to the end
    for i, (name, phases, own) in enumerate(cases):
        path = os.path.join(root, name)
        final = committed_id(path)
        for rank, results in enumerate(per_rank):
            got = results[i]
            assert got["left"] == [], (name, rank, got)  # every planned signal was sent
            signalled = str(rank) in phases
            assert got["raised"] is signalled, (name, rank, got)
            if signalled:
                # deferred (unickpt's handler) / re-raised after the wait (the application's handler)
                said = "which committed first" if own else "which was committed first"
                assert said in got["message"], (name, rank, got)
            # the folder's state was decided when the call raised or returned: no later commit
            assert got["seen"] == final, (name, rank, got, final)
            assert got["seen"] != got["first"], (name, rank, got)  # the interrupted save committed
        ref = torch.load(f"{path}.second.pt", weights_only=True)
        assert not mismatches(_loaded(path), ref), name  # bit-exact: the state of the second save
        assert mismatches(torch.load(f"{path}.first.pt", weights_only=True), ref)  # and it differs
