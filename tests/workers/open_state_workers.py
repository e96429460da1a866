"""Workers of ``test_open_state``: a training loop's whole state (issue 27) in one ``state`` dict.

Two model parts (layers 0-1, layers 2-3), two AdamW with different lr, two CosineAnnealingLR,
an EMA module, a user ``TrainState`` (an int and a tensor) and extra values. The loss is rank
0's batch only (the other ranks' losses times 0) with FSDP2's gradient divide factor 1, so every
world size follows the same trajectory bit for bit: an uninterrupted run at any world size is a
reference for a resumed one at any other.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import unickpt

DIM = 6
STEPS = 3  # steps before the save
LRS = (0.05, 0.01)


class Part(nn.Module):
    """Some of the layers, each under its global number (parts name their layers as the whole does)."""

    def __init__(self, numbers: range) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in numbers})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


class TrainState:
    """A user's train state: an int, a tensor, and a running sum sharded over the ranks (a DTensor
    when a process group exists, which reshards like model tensors)."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = torch.zeros(3, dtype=torch.int64)
        self.sums = torch.zeros(5)
        if dist.is_initialized():
            from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            self.sums = distribute_tensor(self.sums, mesh, [Shard(0)])

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens.clone(), "running": {"sums": self.sums}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.tokens, self.sums = sd["step"], sd["tokens"], sd["running"]["sums"]


def build_parts(sharded: bool) -> tuple[list[nn.Module], nn.Module]:
    torch.manual_seed(0)
    parts: list[nn.Module] = [Part(range(0, 2)), Part(range(2, 4))]
    ema = Part(range(0, 4))
    with torch.no_grad():
        for e, p in zip(ema.parameters(), [q for part in parts for q in part.parameters()]):
            e.copy_(p)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for m in [*parts, ema]:
            fully_shard(m)
            m.set_gradient_divide_factor(1.0)  # a sum (gloo has no PREMUL_SUM): g + 0 + 0 == g exactly
            m.set_force_sum_reduction_for_comms(True)
    return parts, ema


def loop_state(sharded: bool) -> dict[str, Any]:
    parts, ema = build_parts(sharded)
    optims = [torch.optim.AdamW(p.parameters(), lr=lr) for p, lr in zip(parts, LRS)]
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10) for o in optims]
    return {
        "model": parts,
        "optimizer": optims,
        "lr_scheduler": scheds[0],
        "lr_scheduler_1": scheds[1],
        "ema": ema,
        "train_state": TrainState(),
        "extra_state": {"note": ("resume", 1), "seen": 0},
    }


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, DIM, generator=g)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def loss_of(model: Any, step: int) -> torch.Tensor:
    x = batch(step)
    for part in model if isinstance(model, list) else [model]:
        x = part(x)
    return x.square().mean() * (1.0 if _rank() == 0 else 0.0)


def train_step(state: dict[str, Any], step: int) -> float:
    """One step of the loop; returns rank 0's loss (before the update)."""
    optims = state["optimizer"] if isinstance(state["optimizer"], list) else [state["optimizer"]]
    loss = loss_of(state["model"], step)
    loss.backward()
    for o in optims:
        o.step()
        o.zero_grad()
    for key in ("lr_scheduler", "lr_scheduler_1"):
        if key in state:
            state[key].step()
    if "ema" in state:
        with torch.no_grad():
            model = state["model"] if isinstance(state["model"], list) else [state["model"]]
            for e, p in zip(state["ema"].parameters(), [q for m in model for q in m.parameters()]):
                e.lerp_(p, 0.5)
    if "train_state" in state:
        ts = state["train_state"]
        ts.step += 1
        ts.tokens = ts.tokens + torch.tensor([step, 1, 2])
        ts.sums = ts.sums + 0.25 * (step + 1)
    return float(loss.detach())


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Full values of everything (collective for DTensors): parameters, EMA, optimizer state by
    parameter name, group lrs, schedulers, train state, extra values."""
    model = state["model"] if isinstance(state["model"], list) else [state["model"]]
    optims = state["optimizer"] if isinstance(state["optimizer"], list) else [state["optimizer"]]
    names = {id(p): n for m in model for n, p in m.named_parameters()}
    out: dict[str, Any] = {"params": {n: _full(p) for m in model for n, p in m.named_parameters()}}
    out["optim"] = {f"{names[id(p)]}.{k}": _full(v) for o in optims for p, st in o.state.items() for k, v in st.items()}
    out["lrs"] = {names[id(g["params"][0])]: g["lr"] for o in optims for g in o.param_groups}
    if "ema" in state:
        out["ema"] = {n: _full(p) for n, p in state["ema"].named_parameters()}
    for key in ("lr_scheduler", "lr_scheduler_1"):
        if key in state:
            out[key] = (state[key].last_epoch, list(state[key].get_last_lr()))
    if "train_state" in state:
        ts = state["train_state"]
        out["train_state"] = (ts.step, ts.tokens.clone(), _full(ts.sums))
    if "extra_state" in state:
        out["extra_state"] = state["extra_state"]
    return out


def save_ws2(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Train, refuse a save whose replicated train state differs per rank, save, go on one step."""
    del ws
    state = loop_state(sharded=True)
    for step in range(STEPS):
        train_step(state, step)
    out: dict[str, Any] = {}
    good = state["train_state"].step
    state["train_state"].step = good + rank  # ranks disagree: refused before anything is written
    try:
        unickpt.save(os.path.join(root, "refused"), state)
        out["refused"] = ""
    except unickpt.RankDisagreementError as e:
        out["refused"] = str(e)
    refused = os.path.join(root, "refused")
    out["refused_files"] = sorted(os.listdir(refused)) if rank == 0 and os.path.isdir(refused) else []
    state["train_state"].step = good
    state["extra_state"]["seen"] = STEPS
    unickpt.save(os.path.join(root, "ckpt"), state)
    out["saved"] = snapshot(state)
    out["next_loss"] = train_step(state, STEPS)
    out["after_loss"] = float(loss_of(state["model"], STEPS + 1).detach())
    return out


def load_ws3(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Load the ws=2 checkpoint into the same structure at ws=3 (FSDP2); the one-module checkpoint
    (``whole``, saved by the test at ws=1) into the two parts; an uninterrupted run at ws=3 from
    the start for reference."""
    del rank, ws
    state = loop_state(sharded=True)
    for o in state["optimizer"]:
        for g in o.param_groups:
            g["lr"] = 123.0  # must be restored
    state["extra_state"] = None
    unickpt.load(os.path.join(root, "ckpt"), state)
    out = {"loaded": snapshot(state)}
    out["next_loss"] = train_step(state, STEPS)
    out["after_loss"] = float(loss_of(state["model"], STEPS + 1).detach())
    back = loop_state(sharded=True)  # and back: the one-module checkpoint into two FSDP2 parts
    unickpt.load(os.path.join(root, "whole"), back, strict=False)
    out["from_whole"] = snapshot(back)
    ref = loop_state(sharded=True)
    for step in range(STEPS + 1):
        loss = train_step(ref, step)
    out["ref_next_loss"] = loss
    out["ref_after_loss"] = float(loss_of(ref["model"], STEPS + 1).detach())
    return out
