"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/format/test_codec_golden.py``, which holds its single-process tests."""

from __future__ import annotations

import torch

import unickpt
from tests.unit.format.test_codec_golden import _check_extra, _check_state, _collect, _fresh, _golden_copy
from tests.workers.harness import run_ranks


def _fsdp2_load(rank: int, ws: int, ckpt: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model, _ = _fresh()
    fully_shard(model.a)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.9, 0.9), weight_decay=0.0)
    state = {"model": model, "optimizer": optim, "extra_state": None}
    unickpt.load(ckpt, state, framework="fsdp2")
    got = _collect(model, optim)
    _check_state(got, optim)
    _check_extra(state["extra_state"], rank=rank)
    return {"keys": len(got)}


def test_golden_v1_fsdp2_ws3_reshards_to_fsdp2_ws2(tmp_path):
    ckpt = _golden_copy(tmp_path, "v1_fsdp2_ws3")
    assert [r["keys"] for r in run_ranks(_fsdp2_load, 2, ckpt)] == [13, 13]
