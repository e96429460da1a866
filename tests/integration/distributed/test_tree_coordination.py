"""Tree coordination and the commit barrier on real gloo ranks (the scale issue: coordination
shaped as a tree, an asynchronous commit barrier). A configurable ranks-per-host simulates hosts
on this one machine: 8 ranks as 2 "hosts" of 4, fan-out 2.

* the tree gives the collectives and the save plans of the flat coordination, identically, and
  checkpoints saved either way load through the other;
* rank 0 publishes the metadata only after every rank reported (a rank's write held by events);
* a rank SIGKILLed in the middle of its write leaves nothing committed, the previous checkpoint
  loadable, and every surviving rank raises an error naming it and the stage, in time; one
  SIGKILLed before a tree collective is named by the error that travels the tree."""

from __future__ import annotations

import json
import os

import pytest
import torch

import unickpt
from tests.workers.harness import launch_ranks, run_ranks
from tests.workers.tree_workers import _model, held_commit, killed_in_save, tree_vs_flat_and_fsdp2_regular
from unickpt.format.records import METADATA_FILE


def _normalized_metadata(path: str) -> dict:
    doc = json.loads(open(os.path.join(path, METADATA_FILE)).read())
    sid = doc.pop("save_id")
    doc.pop("created_unix")
    return json.loads(json.dumps(doc).replace(sid, "SID"))


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory) -> tuple[str, str, list[list[dict]]]:
    """One spawn of 8 ranks for the next two tests: ``tree_vs_flat`` (DDP) in one folder, then
    ``fsdp2_regular`` in another. Returns ``(ddp folder, fsdp2 folder, per-rank [ddp, fsdp2] results)``."""
    ddp, fsdp2 = str(tmp_path_factory.mktemp("tree-ddp")), str(tmp_path_factory.mktemp("tree-fsdp2"))
    return ddp, fsdp2, run_ranks(tree_vs_flat_and_fsdp2_regular, 8, ddp, fsdp2, timeout=600)


def test_tree_and_flat_give_identical_collectives_plans_and_checkpoints(eight_ranks):
    base = eight_ranks[0]
    res = [r[0] for r in eight_ranks[2]]
    for rank, r in enumerate(res):
        assert r["kinds"] == ["TreeCoordinator", "TorchDistCoordinator"]
        assert r["layout"] == "8 ranks: 2 host(s) (4 rank(s) each) -> 1 group(s) (fan-out 2)"
        assert r["tree"] == r["flat"], rank  # every collective, rank order included
        assert r["plans"]["tree"] == r["plans"]["flat"], rank  # each rank's part of the plan
        assert r["load_exact"] == {"tree<-flat": True, "flat<-tree": True}, rank
    assert res[0]["flat"]["all_gather"] == [
        {"rank": q, "tag": "x" * (q % 3), "nested": [q, (q, str(q))]} for q in range(8)
    ]
    assert res[3]["tree"]["gather_dst3"] == [10 * q for q in range(8)]
    assert "global" in res[0]["plans"]["tree"]  # rank 0's global plan, identical too
    assert _normalized_metadata(f"{base}/tree") == _normalized_metadata(f"{base}/flat")
    for r in res:  # host names: this machine is one host of 8 ranks
        assert r["named"]["layout"] == "8 ranks: 1 host(s) (8 rank(s) each) (fan-out 2)"
        assert r["named"]["all_gather"] == res[0]["flat"]["all_gather"]
        assert r["odd"]["type"] == "RankDisagreementError", r["odd"]  # refused on every rank
        assert "rank 5: (3, 4, 2)" in r["odd"]["msg"] and "rank 0: (2, 4, 2)" in r["odd"]["msg"], r["odd"]


def test_fsdp2_is_planned_as_a_regular_job_through_tree_and_flat(eight_ranks):
    """8 FSDP2 ranks: rank 0 plans on templates (no entry record per rank), the tree and the
    flat coordination give every rank the same part, and the checkpoints load bit-exact."""
    base = eight_ranks[1]
    res = [r[1] for r in eight_ranks[2]]
    assert res[0]["planner"] == "RegularRankPlans" and res[0]["layout_tensors"] > 0, res[0]
    for rank, r in enumerate(res):
        assert r["tree"] == r["flat"], rank
        assert r["load_exact"] == {"tree<-flat": True, "flat<-tree": True}, rank
    assert _normalized_metadata(f"{base}/tree") == _normalized_metadata(f"{base}/flat")


def test_rank_0_publishes_only_after_every_rank_reported(tmp_path):
    res = run_ranks(held_commit, 4, str(tmp_path), timeout=300)
    assert all(r["is_tree"] for r in res)
    assert res[2]["held"]
    assert res[0]["committed"]
    assert res[0]["rank 2 released before the commit"] and res[0]["rank 2 reported before the commit"], res[0]
    assert os.path.exists(tmp_path / "held" / METADATA_FILE)


@pytest.mark.parametrize("phase", ["save.write.file", "save.begin"], ids=["in-its-write", "before-a-tree-collective"])
def test_a_killed_rank_leaves_the_previous_checkpoint_and_is_named(tmp_path, phase):
    """In its write: the commit barrier names it after the timeout. Before the save's first
    collective: its host's leader sees the dead peer at once and the failure travels the tree."""
    base, snap = str(tmp_path), str(tmp_path / "snap.pt")
    timeout = 10.0
    victim = 3
    outcomes = launch_ranks(
        killed_in_save, 4, base, victim, phase, timeout, snap, victim=victim, timeout=300, grace=120
    )
    assert outcomes[victim].status == "killed" and outcomes[victim].exitcode == -9, outcomes
    survivors = [o for o in outcomes if o.rank != victim]
    assert all(o.status == "ok" for o in survivors), [(o.rank, o.status, o.error[-2000:]) for o in survivors]
    for o in survivors:
        r = o.result
        print(f"rank {o.rank}: {r['type']} after {r['seconds']:.1f}s (timeout {timeout:g}s): {r['msg'][:200]}")
        assert r["missing"] == [victim], (o.rank, r)
        if phase == "save.write.file":
            assert r["type"] == "CollectiveTimeoutError", (o.rank, r)
            assert f"rank(s) [{victim}] did not report the end of save (write)" in r["msg"], r["msg"]
            assert "nothing was committed" in r["msg"]
        else:
            assert r["type"] == "CollectiveError", (o.rank, r)
            assert f"rank(s) [{victim}] had not arrived" in r["msg"] and "over the tree" in r["msg"], r["msg"]
    assert len({o.result["msg"] for o in survivors}) == 1  # one decision, the same error everywhere
    # the previous checkpoint is still the committed one, and loads
    ref = torch.load(snap, weights_only=True)
    model, optim = _model(seed=42)
    before = open(os.path.join(base, "ckpt", METADATA_FILE), "rb").read()
    unickpt.load(f"{base}/ckpt", {"model": model, "optimizer": optim}, framework="torch")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
    assert open(os.path.join(base, "ckpt", METADATA_FILE), "rb").read() == before
