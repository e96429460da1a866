"""Issue 40 item 8: torchtitan's ``UnickptCheckpointManager`` with the RAM tier turned on by its
config (``unickpt_fast_root``, ``unickpt_replicas``, ``unickpt_durable_every``), torchtitan's real
debug model, optimizer, scheduler and dataloader on 2 gloo ranks, each a simulated host
(torchtitan_recovery_workers.py). Expected values are the saving ranks' own tensors."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("torchtitan.components.checkpointer")
pytest.importorskip("triton")  # torchtitan's models import it

from tests.support.compare import assert_same_tree
from tests.workers.harness import run_ranks
from tests.workers.torchtitan_recovery_workers import resume, save_three_steps


def test_issue40_item8_torchtitan_config_resumes_from_peers_ram_without_the_folder(tmp_path) -> None:
    root, hosts = str(tmp_path), ["a", "b"]
    saved = run_ranks(save_three_steps, 2, root, hosts, timeout=600)
    assert [s["fresh_load"] for s in saved] == [False, False]
    # every 2nd step to the folder (the tier's layout), nothing else there
    assert saved[0]["folders"] == ["latest", "step_00000002"], saved[0]["folders"]
    shutil.rmtree(os.path.join(root, "checkpoint"))  # the durable copy is gone
    shutil.rmtree(os.path.join(root, "ram", "b"))  # and so is host b's RAM
    res = run_ranks(resume, 2, root, hosts, timeout=600)
    for r, s in zip(res, saved):
        assert r["loaded"] and r["tier"] == "ram" and r["step"] == 3, r
        assert r["bytes"].get("peer", 0) > 0, r["bytes"]  # host b's files came from host a's RAM
        assert_same_tree(s["saved"], r["resumed"], "resumed")
        assert s["saved"]["train_state"]["step"] == 3
        assert r["next_batch"].equal(s["next_batch"])


def test_issue40_item8_torchtitan_config_resumes_on_one_host_fewer_resharded_from_ram(tmp_path) -> None:
    # saved by 3 hosts (FSDP2 over 3 ranks); host b is lost for good: the job restarts on hosts a
    # and c (FSDP2 over 2 ranks), resharded from their RAM (the dataloader's per-rank state skipped)
    root = str(tmp_path)
    saved = run_ranks(save_three_steps, 3, root, ["a", "b", "c"], timeout=600)
    shutil.rmtree(os.path.join(root, "checkpoint"))
    shutil.rmtree(os.path.join(root, "ram", "b"))
    res = run_ranks(resume, 2, root, ["a", "c"], {"dataloader_on_resize": "skip"}, timeout=600)
    for r in res:
        assert r["loaded"] and r["tier"] == "ram" and r["step"] == 3, r
        for key in ("params", "optim", "lrs", "sched", "train_state"):
            assert_same_tree(saved[0]["saved"][key], r["resumed"][key], key)


def test_issue40_item8_torchtitan_config_refuses_a_fast_root_that_is_not_ram() -> None:
    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    with pytest.raises(ValueError, match="unickpt_fast_root must be shm://"):
        UnickptCheckpointManager.Config(unickpt_fast_root="/nfs/job1")
    assert UnickptCheckpointManager.Config().unickpt_fast_root == ""  # off by default
