"""torch.distributed.pipelining with FSDP2 inside each stage (torchtitan's 2-D layout, 4 gloo
ranks): the job resumes at the same layout with the same next-step loss, and its checkpoint
reshards to one stage (FSDP2 over 2 ranks) and to a plain torch model, bit-exact, each stage's
AdamW hyper-parameters kept per parameter."""

from __future__ import annotations

import pytest
import torch

from tests.workers.harness import run_ranks
from tests.workers.pipelining_workers import HYPER, STAGE_LAYERS, one_stage, pipeline_resume, pipeline_save


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pipe") / "ck")
    res = run_ranks(pipeline_save, 4, path)
    # one reference per stage (the DP replicas of a stage gather the same full tensors)
    by_stage = {r["stage"]: r["saved"] for r in res}
    want: dict = {"params": {}, "state": {}, "hyper": {}}
    for s in by_stage.values():
        for k, merged in want.items():
            merged.update(s[k])
    return path, res, want


def _expected_hyper(name: str) -> list:
    stage = next(s for s, layers in STAGE_LAYERS.items() if int(name.split(".")[1]) in layers)
    h = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 1e-2, **HYPER[stage]}  # AdamW defaults + the stage's
    return [h["lr"], list(h["betas"]), h["weight_decay"]]


def _same(got: dict, want: dict) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, t in want["params"].items():
        assert torch.equal(got["params"][name], t), name
        assert got["state"][name].keys() == want["state"][name].keys(), name
        for k, v in want["state"][name].items():
            assert torch.equal(got["state"][name][k], v), (name, k)
        assert got["hyper"][name] == _expected_hyper(name), name


def test_two_stage_fsdp2_job_resumes_at_the_same_layout(saved):
    path, res, want = saved
    assert len(want["params"]) == 8  # 4 layers x (weight, bias), 2 stages together
    got = run_ranks(pipeline_resume, 4, path)
    for before, after in zip(res, got):
        assert after["stage"] == before["stage"]
        assert after["next_loss"] == before["next_loss"]  # the last stage's loss, bit for bit
        stage = {k: {n: v for n, v in want[k].items() if n in after["got"]["params"]} for k in want}
        _same(after["got"], stage)


@pytest.mark.parametrize("world,fsdp2", [pytest.param(2, True, id="fsdp2-2-ranks"), pytest.param(1, False, id="torch")])
def test_two_stage_checkpoint_reshards_to_one_stage(saved, world, fsdp2):
    path, _, want = saved
    _same(run_ranks(one_stage, world, path, fsdp2)[0], want)
