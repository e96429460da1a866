"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/test_tiering.py``, which holds its single-process tests."""

from __future__ import annotations

import os
import shutil

import torch

import unickpt
from tests.unit.test_tiering import (
    _model,
    _values,
    fast_root,  # noqa: F401 (a fixture)
)
from unickpt.storage.shm import shm_base


def test_issue14_tiering_to_s3(s3_bucket, monkeypatch, fast_root):  # noqa: F811 (a fixture)
    for k, v in s3_bucket.endpoint.env().items():
        monkeypatch.setenv(k, v)
    tiers = unickpt.TieredCheckpointManager(fast_root, f"s3://{s3_bucket.name}/job", keep_fast=1)
    model = _model(3)
    for step in (1, 2):
        with torch.no_grad():
            model[1].weight.mul_(2.0)
        tiers.save(step, {"model": model})
    tiers.wait()
    assert [c.step for c in tiers.durable.list_checkpoints()] == [1, 2]
    assert [c.step for c in tiers.fast.list_checkpoints()] == [2]
    shutil.rmtree(os.path.join(shm_base(), fast_root[len("shm://") :]))
    fresh = _model(8)
    assert tiers.load_latest({"model": fresh}) == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in _values(model).items())
    tiers.close()
