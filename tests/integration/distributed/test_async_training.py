"""Async saves while training goes on, in real multi-rank runs: the background copy of
parameters and optimizer state overlaps forward/backward, optimizer.step() waits for it, and the
checkpoint is bit for bit the state at the save call (FSDP1 flat and orig params, FSDP2, DDP)."""

from __future__ import annotations

from tests.workers.fsdp1_workers import async_save_while_training
from tests.workers.harness import run_ranks

SPECS = ["fsdp", "fsdp-orig", "fsdp2", "ddp"]


def test_async_save_while_training_is_the_state_at_the_call(tmp_path):
    results = run_ranks(async_save_while_training, 2, SPECS, str(tmp_path))
    for rank, res in enumerate(results):
        for spec in SPECS:
            r = res[spec]
            assert not r["missing"] and not r["extra"], (spec, r["missing"], r["extra"])
            assert not r["mismatched"], f"rank {rank} {spec}: not the state at the save call: {r['mismatched'][:5]}"
            assert r["groups_equal"], (rank, spec)
            assert r["extra_state"]["step"] == 2 and r["extra_state"]["rank"] == rank
            assert r["step_waited_for_copy"] == [True, True], (rank, spec)
