"""Rank functions of the torch.distributed.pipelining tests (torchtitan's layout): a 4-layer model
split into 2 pipeline stages, each stage FSDP2-sharded over its own data-parallel sub-mesh of a
("pp", "dp") = (2, 2) DeviceMesh, run by GPipe, each stage with its own AdamW hyper-parameters.
Stage modules keep the full model's module names (``layers.2.weight`` on stage 1), as torchtitan's
pipeline splitting does, so one checkpoint serves any stage split.

References are taken with torch's own APIs (``full_tensor()`` of parameters and optimizer state);
results are plain values the test process compares."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import unickpt

LAYERS = 4
DIM = 8
STAGE_LAYERS = {0: [0, 1], 1: [2, 3]}
HYPER = {0: {"lr": 1e-2, "betas": (0.9, 0.99)}, 1: {"lr": 4e-3, "betas": (0.7, 0.95), "weight_decay": 0.2}}


class Model(nn.Module):
    """``layers.<i>`` Linear layers applied in order (a stage holds some of them)."""

    def __init__(self, keep: list[int], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        full = [nn.Linear(DIM, DIM) for _ in range(LAYERS)]
        self.layers = nn.ModuleDict({str(i): full[i] for i in keep})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def _data(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and its AdamW state as full tensors, and each parameter's lr / betas /
    weight_decay (collective over the sharding mesh for DTensors)."""
    out: dict[str, Any] = {"params": {}, "state": {}, "hyper": {}}
    for name, p in model.named_parameters():
        out["params"][name] = _full(p)
        out["state"][name] = {k: _full(v) for k, v in optim.state[p].items()}
        g = next(g for g in optim.param_groups if any(q is p for q in g["params"]))
        out["hyper"][name] = [g["lr"], list(g["betas"]), g["weight_decay"]]
    return out


def _pipeline_job(seed: int, defaults: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any, int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = Model(STAGE_LAYERS[pp_rank], seed)
    for layer in part.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(part, mesh=mesh["dp"])
    optim = torch.optim.AdamW(part.parameters(), **({} if defaults else HYPER[pp_rank]))
    stage = PipelineStage(part, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    return part, optim, ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss), pp_rank, dp_rank


def _step(optim: torch.optim.Optimizer, schedule: Any, pp_rank: int, dp_rank: int, step: int) -> float:
    x, y = _data(step, dp_rank)
    losses: list[torch.Tensor] = []
    if pp_rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(sum(loss.detach() for loss in losses)) if losses else 0.0


def pipeline_save(rank: int, ws: int, path: str) -> dict[str, Any]:
    """Train 2 steps, save, then one more step: its loss is what a resumed job must reproduce."""
    part, optim, schedule, pp, dp = _pipeline_job(seed=0, defaults=False)
    for s in range(2):
        _step(optim, schedule, pp, dp, s)
    unickpt.save(path, {"model": part, "optimizer": optim}).wait()
    saved = full_state(part, optim)
    return {"saved": saved, "next_loss": _step(optim, schedule, pp, dp, 2), "stage": pp}


def pipeline_resume(rank: int, ws: int, path: str) -> dict[str, Any]:
    """The same layout, fresh objects with default hyper-parameters: load strictly, then step."""
    part, optim, schedule, pp, dp = _pipeline_job(seed=7, defaults=True)
    unickpt.load(path, {"model": part, "optimizer": optim})
    got = full_state(part, optim)
    return {"got": got, "next_loss": _step(optim, schedule, pp, dp, 2), "stage": pp}


def one_stage(rank: int, ws: int, path: str, fsdp2: bool) -> dict[str, Any]:
    """The whole model in one stage: FSDP2 over every rank (``fsdp2``) or a plain module on one
    rank, with one AdamW group per saved stage (default hyper-parameters before the load)."""
    model = Model(list(range(LAYERS)), seed=7)
    if fsdp2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
    groups = [
        {"params": [p for i in STAGE_LAYERS[s] for p in model.layers[str(i)].parameters()]}
        for s in sorted(STAGE_LAYERS)
    ]
    optim = torch.optim.AdamW(groups)
    unickpt.load(path, {"model": model, "optimizer": optim})
    got = full_state(model, optim)
    if dist.is_initialized():
        dist.barrier()
    return got if rank == 0 else {}
