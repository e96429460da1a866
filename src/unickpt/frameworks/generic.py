"""Adapters for frameworks whose live tensors already say which box they hold.

``torch`` (one process), ``ddp`` (replicated plain tensors), ``fsdp2`` (``fully_shard``: DTensor
Shard(0), uneven shards unpadded), ``dtensor`` (``parallelize_module`` TP on 1-D/2-D meshes,
FSDP2+TP). They share one implementation: DTensors contribute their local box, plain tensors the
full box (replicas), and FQNs are cleaned of wrapper prefixes. Replicated buffers are saved
from the replica the framework treats as the source (``buffer_source``: DDP broadcasts rank 0's
before every forward), parameters and optimizer state from whichever replica balances the bytes.
Optimizer state is loaded by ``optim_state.OptimizerLoad`` with ``ParamLayout``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..errors import FrameworkError
from ..format.records import Metadata
from ..planning.specs import LoadItem, SaveItem
from .base import MODEL_PREFIX, OPTIM_PREFIX, LoadView, SaveView, register_framework
from .module_state import items_for, model_tensors, optimizer_save, param_fqns, refuse_meta
from .optim_state import OptimizerLoad, read_saved

__all__ = ["ModuleAdapter", "ParamLayout", "module_of", "optimizer_of", "buffer_source"]


def module_of(state: Mapping[str, Any]) -> nn.Module | None:
    model = state.get("model")
    if model is not None and not isinstance(model, nn.Module):
        raise FrameworkError(f'state["model"] must be an nn.Module, got {type(model).__name__}')
    return model


def optimizer_of(state: Mapping[str, Any]) -> torch.optim.Optimizer | None:
    optim = state.get("optimizer")
    if optim is None:
        return None
    if not isinstance(optim, torch.optim.Optimizer):
        raise FrameworkError(f'state["optimizer"] must be a torch.optim.Optimizer, got {type(optim).__name__}')
    if state.get("model") is None:
        raise FrameworkError('state["optimizer"] needs state["model"] to name its parameters')
    return optim


def _has_dtensor(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def _mesh_of(module: nn.Module) -> tuple[tuple[str, int], ...]:
    for p in module.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            return tuple((str(n), int(s)) for n, s in zip(names, mesh.shape))
    return ()


def buffer_source(module: nn.Module) -> int | None:
    """The rank whose buffers are authoritative among replicas: rank 0 of a DDP model's process
    group (DDP broadcasts its buffers before every forward), else global rank 0 (None without a
    process group)."""
    if isinstance(module, DistributedDataParallel):
        return int(dist.get_process_group_ranks(module.process_group)[0])
    return 0 if dist.is_available() and dist.is_initialized() else None


class ParamLayout:
    """``optim_state.StateLayout`` for tensors that say which box they hold (plain, DTensor)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names

    def fqns(self, p: torch.Tensor) -> tuple[str, ...]:
        return (self.names[id(p)],)

    def param_shape(self, p: torch.Tensor, fqn: str) -> tuple[int, ...]:
        return tuple(p.shape)

    def like(self, p: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return p, False

    def holds(self, p: torch.Tensor) -> bool:
        return True  # even an empty local shard of a DTensor gets a gradient, hence state

    def describe(self, p: torch.Tensor, name: str, t: torch.Tensor) -> tuple[list[LoadItem], list[LoadItem]]:
        return [items_for(f"{OPTIM_PREFIX}state.{self.names[id(p)]}.{name}", t, LoadItem)], []


class ModuleAdapter:
    """Shared implementation; subclasses set ``name`` and ``matches``."""

    name = "torch"
    strip_module = True

    def matches(self, state: Mapping[str, Any]) -> bool:
        return True

    def check(self, module: nn.Module) -> None:
        """Reject objects that clearly belong to another framework."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise FrameworkError(f"framework={self.name!r} got an FSDP1 model; use framework='fsdp'")

    def save_view(self, state: Mapping[str, Any]) -> SaveView:
        module = module_of(state)
        optim = optimizer_of(state)
        view = SaveView(items=[])
        if module is None:
            return view
        self.check(module)
        view.mesh = _mesh_of(module)
        buffers = {id(b) for b in module.buffers()}
        source = buffer_source(module) if buffers else None
        for fqn, t in model_tensors(module, self.strip_module):
            view.items.append(items_for(MODEL_PREFIX + fqn, t, SaveItem, source if id(t) in buffers else None))
        refuse_meta(view.items, saving=True)
        if optim is not None:
            items, objects = optimizer_save(
                optim,
                param_fqns(module, self.strip_module),
                lambda fqn, t, p: [items_for(fqn, t, SaveItem)],
            )
            view.items.extend(items)
            view.objects.update(objects)
        return view

    def load_view(self, state: Mapping[str, Any], md: Metadata | None = None, strict: bool = True) -> LoadView:
        module = module_of(state)
        optim = optimizer_of(state)
        view = LoadView(items=[], prefixes=())
        if module is None:
            return view
        self.check(module)
        view.prefixes = (MODEL_PREFIX,)
        for fqn, t in model_tensors(module, self.strip_module):
            view.items.append(items_for(MODEL_PREFIX + fqn, t, LoadItem))
        refuse_meta(view.items, saving=False)
        if optim is not None:
            load = OptimizerLoad(optim, ParamLayout(param_fqns(module, self.strip_module)), read_saved(md), strict)
            view.items.extend(load.items)
            view.probes, view.validate, view.apply = load.probes, load.validate, load.apply
            view.prefixes = (MODEL_PREFIX, OPTIM_PREFIX)
        return view


class TorchAdapter(ModuleAdapter):
    name = "torch"


class DDPAdapter(ModuleAdapter):
    name = "ddp"

    def matches(self, state: Mapping[str, Any]) -> bool:
        return isinstance(state.get("model"), DistributedDataParallel)


class FSDP2Adapter(ModuleAdapter):
    name = "fsdp2"

    def matches(self, state: Mapping[str, Any]) -> bool:
        from torch.distributed.fsdp import FSDPModule

        model = state.get("model")
        return isinstance(model, nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())


class DTensorAdapter(ModuleAdapter):
    name = "dtensor"

    def matches(self, state: Mapping[str, Any]) -> bool:
        model = state.get("model")
        return isinstance(model, nn.Module) and _has_dtensor(model)


register_framework(TorchAdapter())
register_framework(DTensorAdapter(), auto_priority=0)
register_framework(FSDP2Adapter(), auto_priority=0)
register_framework(DDPAdapter(), auto_priority=0)
