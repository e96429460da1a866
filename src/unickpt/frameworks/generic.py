"""Adapters for frameworks whose live tensors already say which box they hold.

``torch`` (one process), ``ddp`` (replicated plain tensors), ``fsdp2`` (``fully_shard``: DTensor
Shard(0), uneven shards unpadded), ``dtensor`` (``parallelize_module`` TP on 1-D/2-D meshes,
FSDP2+TP). They share one description (``ModuleAdapter.describe``): DTensors contribute their
local box, plain tensors the full box (replicas), and FQNs are cleaned of wrapper prefixes
(DDP, torch.compile, activation checkpointing). Replicated buffers are saved from the replica
the framework treats as the source (``buffer_source``: DDP broadcasts rank 0's before every
forward), parameters and optimizer state from whichever replica balances the bytes. Every
optimizer parameter's state is laid out like the parameter (``module_state.TensorState``).
They differ in ``matches`` (framework="auto"; priorities in ``registry``) and in the name
recorded in the checkpoint.
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
from .base import MODEL_PREFIX, OptimizerDescription, ParamState, StateDescription
from .module_state import BoxMemo, TensorState, model_tensors, module_of, optimizer_of, param_fqns, tensor_piece
from .views import DescribedAdapter

__all__ = ["ModuleAdapter", "TorchAdapter", "DDPAdapter", "FSDP2Adapter", "DTensorAdapter", "buffer_source"]


def _mesh_of(module: nn.Module) -> tuple[tuple[str, int], ...]:
    for p in module.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            return tuple((str(n), int(s)) for n, s in zip(names, mesh.shape))
    return ()


def _ddp_of(module: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper in ``module`` (itself, or inside torch.compile's wrapper), if any."""
    return next((m for m in module.modules() if isinstance(m, DistributedDataParallel)), None)


def buffer_source(module: nn.Module) -> int | None:
    """The rank whose buffers are authoritative among replicas: rank 0 of a DDP model's process
    group (DDP broadcasts its buffers before every forward), else global rank 0 (None without a
    process group)."""
    ddp = _ddp_of(module)
    if ddp is not None:
        return int(dist.get_process_group_ranks(ddp.process_group)[0])
    return 0 if dist.is_available() and dist.is_initialized() else None


class ModuleAdapter(DescribedAdapter):
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

    def describe(self, state: Mapping[str, Any]) -> StateDescription | None:
        module = module_of(state)
        optim = optimizer_of(state)
        if module is None:
            return None
        self.check(module)
        buffers = {id(b) for b in module.buffers()}
        source = buffer_source(module) if buffers else None
        memo = BoxMemo()
        with torch.no_grad():
            model = tuple(
                tensor_piece(MODEL_PREFIX + fqn, t, source if id(t) in buffers else None, memo)
                for fqn, t in model_tensors(module, self.strip_module)
            )
        if optim is None:
            return StateDescription(model, None, _mesh_of(module))
        names = param_fqns(module, self.strip_module)
        params: dict[int, ParamState] = {}
        for gi, g in enumerate(optim.param_groups):
            for p in g["params"]:
                if id(p) not in names:
                    raise FrameworkError(
                        f"optimizer param group {gi} holds a parameter (shape {tuple(p.shape)}) that is not in "
                        "the model; every parameter the optimizer updates must be a parameter of state['model']"
                    )
                params[id(p)] = TensorState(names[id(p)], p, memo)
        return StateDescription(model, OptimizerDescription(optim, params), _mesh_of(module))


class TorchAdapter(ModuleAdapter):
    name = "torch"


class DDPAdapter(ModuleAdapter):
    name = "ddp"

    def matches(self, state: Mapping[str, Any]) -> bool:
        model = state.get("model")
        return isinstance(model, nn.Module) and _ddp_of(model) is not None


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
        return isinstance(model, nn.Module) and any(isinstance(p, DTensor) for p in model.parameters())
