"""Issue 27's multi-rank case: a training loop's whole state (two FSDP2 model parts, two AdamW with
different lr, two CosineAnnealingLR, an EMA module, a user Stateful, extra values) saved at ws=2,
loaded bit-exact at ws=3 (FSDP2), at ws=1 (plain torch, same structure) and at ws=1 into one
module with all layers and one AdamW with two param groups; the next step's loss equals an
uninterrupted run. One spawn per world size (ws=1 runs in the test process); the ws=2 spawn
also checks that ranks disagreeing on a replicated Stateful are refused before anything is
written."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

import unickpt
from tests.support.compare import assert_same_tree
from tests.workers.harness import run_ranks
from tests.workers.open_state_workers import (
    LRS,
    STEPS,
    Part,
    load_ws3,
    loop_state,
    loss_of,
    save_ws2,
    snapshot,
    train_step,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("open_state"))
    return root, run_ranks(save_ws2, 2, root)


def _whole() -> tuple[Part, torch.optim.AdamW]:
    """One module with all layers and one AdamW with two param groups (layers 0-1, 2-3)."""
    torch.manual_seed(5)
    whole = Part(range(0, 4))
    params = list(whole.named_parameters())
    groups = [
        {"params": [p for n, p in params if n.split(".")[1] in "01"], "lr": 9.0},
        {"params": [p for n, p in params if n.split(".")[1] in "23"], "lr": 9.0},
    ]
    return whole, torch.optim.AdamW(groups)


@pytest.fixture(scope="module")
def ws3(saved) -> list[dict[str, Any]]:
    root, _ = saved
    whole, opt = _whole()  # the ws=2 checkpoint through one module, saved at ws=1 for the way back
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unickpt.load(os.path.join(root, "ckpt"), {"model": whole, "optimizer": opt}, strict=False)
    unickpt.save(os.path.join(root, "whole"), {"model": whole, "optimizer": opt})
    return run_ranks(load_ws3, 3, root)


def test_replicated_stateful_that_differs_between_ranks_is_refused_before_writing(saved):
    _, out = saved
    for r in out:
        assert "replicated state" in r["refused"] and "'train_state'" in r["refused"]
        assert "rank 0" in r["refused"] and "rank 1" in r["refused"]  # the ranks, each with its own value
    assert not any(f.startswith("unickpt.metadata") for f in out[0]["refused_files"])


def test_saved_at_ws2_loads_bit_exact_at_ws3_fsdp2(saved, ws3):
    _, out = saved
    want = out[0]["saved"]
    assert [lr for lr in want["lrs"].values()] != [LRS[0]] * 2  # the schedulers moved them
    for r in ws3:
        assert_same_tree(want, r["loaded"], "ws3", strict_types=True)


def test_one_module_checkpoint_loads_back_into_two_fsdp2_parts_at_ws3(saved, ws3):
    _, out = saved
    want = out[0]["saved"]
    for r in ws3:
        for what in ("params", "optim", "lrs"):  # two AdamW again, each with its group's lr
            assert_same_tree(want[what], r["from_whole"][what], f"from_whole.{what}", strict_types=True)


def test_next_step_at_ws3_equals_an_uninterrupted_run(saved, ws3):
    _, out = saved
    r = ws3[0]
    assert r["ref_next_loss"] == out[0]["next_loss"]  # the trajectory is the same at every world size
    assert r["next_loss"] == r["ref_next_loss"]
    assert r["after_loss"] == r["ref_after_loss"] == out[0]["after_loss"]


def test_saved_at_ws2_loads_at_ws1_plain_torch_same_structure(saved):
    root, out = saved
    state = loop_state(sharded=False)
    state["extra_state"] = None
    unickpt.load(os.path.join(root, "ckpt"), state)
    assert_same_tree(out[0]["saved"], snapshot(state), "ws1", strict_types=True)
    assert state["extra_state"] == {"note": ("resume", 1), "seen": STEPS}
    ref = loop_state(sharded=False)
    for step in range(STEPS):
        train_step(ref, step)
    ref_next = train_step(ref, STEPS)
    assert train_step(state, STEPS) == ref_next == out[0]["next_loss"]
    after = float(loss_of(state["model"], STEPS + 1).detach())
    assert after == float(loss_of(ref["model"], STEPS + 1).detach()) == out[0]["after_loss"]


def test_saved_at_ws2_loads_into_one_module_with_one_optimizer_of_two_groups(saved):
    root, out = saved
    whole, opt = _whole()
    state: dict[str, Any] = {"model": whole, "optimizer": opt}
    with pytest.raises(unickpt.UnexpectedKeysError, match="ema.*lr_scheduler.*lr_scheduler_1.*train_state"):
        unickpt.load(os.path.join(root, "ckpt"), state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unickpt.load(os.path.join(root, "ckpt"), state, strict=False)
    assert any("train_state" in str(w.message) for w in caught)
    want = out[0]["saved"]
    got = snapshot(state)
    assert_same_tree(want["params"], got["params"], "params", strict_types=True)
    assert_same_tree(want["optim"], got["optim"], "optim", strict_types=True)
    assert_same_tree(want["lrs"], got["lrs"], "lrs", strict_types=True)  # each group's lr restored, per parameter
    assert train_step(state, STEPS) == out[0]["next_loss"]
    assert float(loss_of(whole, STEPS + 1).detach()) == out[0]["after_loss"]
