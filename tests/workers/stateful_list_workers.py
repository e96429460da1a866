"""Workers of ``test_stateful_lists_processes`` (issue 39 item 9): a list of LR schedulers and a
list of user Statefuls (one holding a DTensor sharded over the ranks) under one key each, saved
by 2 gloo ranks and loaded by 3 (and by 1 in the test process).

Every rank trains the same plain modules on the same batch, so the replicated state is equal on
every rank; the tracker's DTensor holds ``arange(6) * step`` whatever the world size."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import unickpt

STEPS = 3
ROWS = 6


class Tracker:
    """A user Stateful with a step and a running sum sharded over the ranks (a DTensor when a
    process group exists, a plain tensor otherwise)."""

    def __init__(self) -> None:
        self.step = 0
        self.sums = torch.zeros(ROWS)
        if dist.is_initialized():
            from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            self.sums = distribute_tensor(self.sums, mesh, [Shard(0)])

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sums": self.sums}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.sums = sd["step"], sd["sums"]


def build(seed: int = 0) -> dict[str, Any]:
    """Two modules with an optimizer and an LR scheduler each, and a list of two trackers."""
    torch.manual_seed(seed)
    model, head = nn.Linear(4, 4), nn.Linear(4, 2)
    optims = [torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.AdamW(head.parameters(), lr=0.1)]
    scheds = [
        torch.optim.lr_scheduler.StepLR(optims[0], step_size=2, gamma=0.5),
        torch.optim.lr_scheduler.CosineAnnealingLR(optims[1], T_max=10),
    ]
    trackers = [Tracker(), Tracker()]
    return {"model": model, "head": head, "optimizer": optims, "lr_scheduler": scheds, "trackers": trackers}


def train(state: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        state["head"](state["model"](torch.ones(2, 4))).sum().backward()
        for o, s in zip(state["optimizer"], state["lr_scheduler"]):
            o.step()
            o.zero_grad()
            s.step()
        for i, t in enumerate(state["trackers"]):
            t.step += 1
            with torch.no_grad():
                t.sums.add_(_full_like(t.sums, torch.arange(ROWS, dtype=torch.float32) * (i + 1)))


def _full_like(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``like`` (a DTensor: this rank's shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements)
    return full


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """What a resume must restore, as plain values: every rank's view is the same."""
    from torch.distributed.tensor import DTensor

    sums = [t.sums.full_tensor() if isinstance(t.sums, DTensor) else t.sums for t in state["trackers"]]
    return {
        "epochs": [s.last_epoch for s in state["lr_scheduler"]],
        "lrs": [s.get_last_lr() for s in state["lr_scheduler"]],
        "optim_lrs": [o.param_groups[0]["lr"] for o in state["optimizer"]],
        "steps": [t.step for t in state["trackers"]],
        "sums": [s.tolist() for s in sums],
        "sums_types": [type(t.sums).__name__ for t in state["trackers"]],
    }


def save_ws2(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Train; a save whose scheduler list differs on one rank is refused; save; snapshot."""
    del ws
    state = build()
    train(state, STEPS)
    out: dict[str, Any] = {}
    state["lr_scheduler"][1].last_epoch += rank  # ranks disagree on the second scheduler
    try:
        unickpt.save(os.path.join(root, "refused"), state)
        out["refused"] = ""
    except unickpt.RankDisagreementError as e:
        out["refused"] = str(e)
    state["lr_scheduler"][1].last_epoch -= rank
    unickpt.save(os.path.join(root, "ckpt"), state)
    out["saved"] = snapshot(state)
    return out


def load(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Load into a fresh state (another seed); a list of another length is refused, naming the key."""
    del rank, ws
    state = build(seed=1)
    unickpt.load(os.path.join(root, "ckpt"), state)
    out: dict[str, Any] = {"loaded": snapshot(state)}
    train(state, 1)
    out["next"] = snapshot(state)
    short = build(seed=1)
    short["lr_scheduler"] = short["lr_scheduler"][:1]
    try:
        unickpt.load(os.path.join(root, "ckpt"), short)
        out["short"] = ""
    except unickpt.errors.StatefulListMismatchError as e:
        out["short"] = str(e)
    return out
