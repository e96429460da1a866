"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/test_checkpointer.py``, which holds its single-process tests."""

from __future__ import annotations

import torch

import unickpt
from tests.unit.test_checkpointer import _model, _step
from tests.workers.harness import run_ranks


def _actor_critic(rank: int, ws: int, root: str) -> dict:
    """ws=2 gloo: each rank saves an actor and a critic through two checkpointers at once,
    then both load back (into fresh objects) bit-exact."""
    from torch.distributed.fsdp import fully_shard

    states = {}
    with unickpt.Checkpointer() as actor_ckpt, unickpt.Checkpointer() as critic_ckpt:
        handles = []
        for name, ckpt, seed in (("actor", actor_ckpt, 1), ("critic", critic_ckpt, 2)):
            model, _ = _model(seed)
            fully_shard(model)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            _step(model, optim, seed)
            states[name] = {k: v.full_tensor() for k, v in model.state_dict().items()}
            handles.append(ckpt.save(f"{root}/{name}", {"model": model, "optimizer": optim}, async_save=True))
        for h in handles:
            h.wait()
        ok = {}
        for name, ckpt, seed in (("actor", actor_ckpt, 1), ("critic", critic_ckpt, 2)):
            model, _ = _model(seed + 50)
            fully_shard(model)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            _step(model, optim, seed + 50)
            ckpt.load(f"{root}/{name}", {"model": model, "optimizer": optim})
            got = {k: v.full_tensor() for k, v in model.state_dict().items()}
            ok[name] = all(torch.equal(got[k], states[name][k]) for k in got)
    return ok


def test_two_checkpointers_at_world_size_2(tmp_path):
    for r in run_ranks(_actor_critic, 2, str(tmp_path)):
        assert r == {"actor": True, "critic": True}
