"""Fabric rank functions of tests/integration/integrations/test_lightning.py: a manual loop (model, AdamW,
StepLR, a step counter) checkpointed with ``fabric.save`` / ``fabric.load``, through unickpt's
Fabric strategies or through stock Fabric's own checkpointing. Called inside the Trainer test's
spawns (``lightning_workers``), so Fabric costs no spawn of its own."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric import strategies as stock
from torch import nn

from unickpt.integrations.lightning import (
    UnickptFabricDDPStrategy,
    UnickptFabricFSDPStrategy,
    UnickptFabricModelParallelStrategy,
)

SAMPLES, BATCH = 24, 4


def _parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


class StockFSDPStrategy(stock.FSDPStrategy):
    """Fabric's own ``FSDPStrategy``, unchanged: a subclass only because Fabric's connector refuses
    ``type(strategy) is FSDPStrategy`` without a GPU accelerator."""


def _wrap_fsdp1(model: nn.Sequential) -> nn.Module:
    """FSDP1 on the CPU device, each Linear then the whole: Fabric's own wrapping passes device_id=None,
    which torch's FSDP1 refuses without an accelerator ("FSDP needs a non-CPU accelerator device")."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    cpu = torch.device("cpu")
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Linear):
            model[i] = FullyShardedDataParallel(layer, device_id=cpu, use_orig_params=True)
    return FullyShardedDataParallel(model, device_id=cpu, use_orig_params=True)


def _strategy(kind: str, backend: str, ws: int) -> Any:
    if kind == "fsdp1":
        cls = UnickptFabricFSDPStrategy if backend == "unickpt" else StockFSDPStrategy
        return cls()  # the module comes wrapped (_wrap_fsdp1)
    if kind == "ddp":
        return UnickptFabricDDPStrategy(async_save=True) if backend == "unickpt" else stock.DDPStrategy()
    cls = UnickptFabricModelParallelStrategy if backend == "unickpt" else stock.ModelParallelStrategy
    return cls(parallelize_fn=_parallelize, data_parallel_size=ws, tensor_parallel_size=1)


def fabric_run(kind: str, backend: str, rank: int, ws: int, path: str, resume: bool, steps: int) -> list[float]:
    """``steps`` steps then ``fabric.save(path)``; with ``resume``: ``fabric.load(path)`` first,
    no save. Each step's batch is chosen by the step counter, so a resumed run goes on where
    the saved one stopped. Returns this rank's losses."""
    strategy = _strategy(kind, backend, ws)
    fabric = L.Fabric(accelerator="cpu", devices=ws, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if kind == "fsdp1":
        module = _wrap_fsdp1(module)
    model = fabric.setup_module(module)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=2, gamma=0.5)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "sched": sched, "step": 0}
    if resume:
        fabric.load(path, state)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1, generator=g)
    losses = []
    for _ in range(steps):
        start = (state["step"] * ws + rank) * BATCH % SAMPLES
        loss = F.mse_loss(model(x[start : start + BATCH]), y[start : start + BATCH])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        state["step"] += 1
        losses.append(loss.item())
    if not resume:
        fabric.save(path, state)
        if backend == "unickpt":
            strategy.checkpointer.wait()
    else:
        losses.append(float(state["step"]))
    return losses
