"""Every rank agrees on what it does, a missing rank is named in time, and the same fault gives
the same error at every world size (issue 9, items 5, 6 and 12). Real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

import unickpt
from tests.workers.coord_workers import disagreeing_ranks, same_faults, skipping_rank, staggered_async_failure
from tests.workers.harness import run_ranks


# The agreement rule itself is checked at world sizes 1, 2, 3 and 5 with thread-ranks
# (tests/unit/coordination/test_base_run_stage.py); this gloo run proves its wiring into save and load.
@pytest.mark.parametrize("ws", [3])
def test_issue9_item5_ranks_must_agree_on_path_framework_and_role(tmp_path, ws):
    base = str(tmp_path)
    res = run_ranks(disagreeing_ranks, ws, base)
    for rank, r in enumerate(res):
        for case in ("path", "framework", "role", "load_path"):
            assert r[case]["type"] == "RankDisagreementError", (rank, case, r[case])
        msg = r["path"]["msg"]
        assert all(f"{base}/ckpt-{1000 + q}" in msg for q in range(ws)), msg  # every rank's value
        assert all(f"rank {q}" in msg for q in range(ws)), msg
        assert "'ddp'" in r["framework"]["msg"] and "'torch'" in r["framework"]["msg"]
        assert "'actor'" in r["role"]["msg"] and "None" in r["role"]["msg"]
        load_msg = r["load_path"]["msg"]
        assert f"{base}/good" in load_msg and all(f"{base}/ckpt-{1000 + q}" in load_msg for q in range(1, ws))
        assert r["exact"], rank
    # refused before anything was written: no file at any rank's path, nor at the shared one
    assert all(files == [] for files in res[0]["written"].values()), res[0]["written"]
    assert res[0]["written_same"] == []


@pytest.mark.parametrize(
    ("ws", "op", "skipper", "warm"),
    [(2, "save", 1, False), (3, "save", 2, True), (2, "load", 0, True), (3, "load", 1, False)],
)
def test_issue9_item6_a_rank_that_skips_is_named_within_the_job_timeout(tmp_path, ws, op, skipper, warm):
    _skip_one_rank(tmp_path, ws, op, skipper, warm, init_timeout=4, option=None)


@pytest.mark.parametrize("op", ["save", "load"])
def test_issue9_item6_options_timeout_is_the_deadline_of_each_collective(tmp_path, op):
    """The job allows 10 minutes; the call's own timeout (3 s) decides."""
    msg = _skip_one_rank(tmp_path, 2, op, 1, True, init_timeout=600, option=3.0)
    assert "timed out after 3s" in msg, msg


def _skip_one_rank(tmp_path, ws, op, skipper, warm, init_timeout, option) -> str:
    base = str(tmp_path)
    if op == "load":  # a checkpoint to load, saved by one process
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        unickpt.save(f"{base}/ready", {"model": m, "optimizer": opt}, framework="torch")
    # the test allows 120 s, far below the 30 minutes unickpt's own groups used to wait
    res = run_ranks(skipping_rank, ws, base, op, skipper, warm, option, init_timeout=init_timeout, timeout=120)
    assert res[skipper] == {"skipped": True}
    arrived = [r for q, r in enumerate(res) if q != skipper]
    for r in arrived:
        assert r["type"] == "CollectiveTimeoutError" and r["checkpoint_error"], r
        assert f"rank(s) [{skipper}] did not arrive" in r["msg"], r["msg"]
        assert base in r["msg"] and op in r["msg"], r["msg"]
    assert len({r["msg"] for r in arrived}) == 1  # the same error on every rank that arrived
    assert not os.path.exists(f"{base}/ckpt/unickpt.metadata.json")
    return arrived[0]["msg"]


def test_issue9_item12_same_fault_same_error_type_at_every_world_size(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()  # one process without a group: run here, no spawn needed
    one = [same_faults(0, 1, str(tmp_path / "ws1"))]
    two = run_ranks(same_faults, 2, str(tmp_path / "ws2"))
    expected = {
        "unencodable": "UnsupportedValueError",
        "missing": "MissingDataFileError",
        "shape": "ShapeMismatchError",
    }
    for case, want in expected.items():
        got = [r[case]["type"] for r in one + two]
        assert got == [want] * 3, (case, [r[case] for r in one + two])
        assert all(r[case]["checkpoint_error"] for r in one + two)
    assert (
        "extra_state" in one[0]["unencodable"]["msg"] and "builtin_function_or_method" in one[0]["unencodable"]["msg"]
    )
    # a non-CheckpointError (or different types on different ranks): RankFailures holding the
    # per-rank exception objects with their attributes, at every world size
    solo = one[0]["mixed"]
    assert solo["type"] == "RankFailures" and solo["ranks"] == [0] and solo["types"] == {0: "PermissionError"}
    assert solo["errno0"] == 13 and solo["filename0"] == f"{tmp_path}/ws1/loader"
    for rank, r in enumerate(two):
        mixed = r["mixed"]
        assert mixed["type"] == "RankFailures" and mixed["ranks"] == [0, 1], (rank, mixed)
        assert mixed["types"] == {0: "PermissionError", 1: "RemoteRankError" if rank == 0 else "TwoArgError"}, mixed
        assert mixed["errno0"] == 13 and mixed["filename0"] == f"{tmp_path}/ws2/loader", mixed
        assert "injected: permission denied" in mixed["messages"][0]
        assert "odd:7" in mixed["messages"][1]
        if rank == 0:  # rank 1's exception could not be rebuilt here: its type, text and traceback
            assert mixed["remote1"] == "TwoArgError" and "coord_workers.py" in mixed["remote1_tb"], mixed


def test_issue10_item4_async_failure_reported_once_on_every_rank_when_workers_finish_apart(tmp_path):
    base = str(tmp_path)
    res = run_ranks(staggered_async_failure, 2, base, init_timeout=30, timeout=180)
    assert res[1]["gate_hit"]  # rank 1 really finished the failed save later than rank 0
    for r in res:
        assert len(r["seen"]) == 1, r  # reported once (by the next save, or by wait_all)
        (seen,) = r["seen"]
        assert seen["type"] == "AsyncSaveFailures" and seen["paths"] == [f"{base}/first"], r
    assert res[0]["seen"][0]["call"] == res[1]["seen"][0]["call"]  # by the same call on every rank
