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

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..errors import FrameworkError
from ..format.records import Metadata
from .base import LoadView, OptimizerDescription, ParamState, Piece, StateDescription
from .fsdp1 import fsdp_package, holds_fsdp1
from .module_state import (
    BoxMemo,
    TensorState,
    check_loads_in_place,
    model_tensors,
    optimizer_of,
    param_fqns,
    tensor_piece,
)
from .parts import model_parts, part_name, part_prefix
from .plain import PlainTensor, module_plain_tensors
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
        if holds_fsdp1(module):
            raise FrameworkError(f"framework={self.name!r} got an FSDP1 model; use framework='fsdp'")

    def load_view(self, state: Mapping[str, Any], md: Metadata | None = None, strict: bool = True) -> LoadView:
        for key, module in _parts_of(state) or ():
            check_loads_in_place(key, module)
        return super().load_view(state, md, strict)

    def plain_tensors(self, state: Mapping[str, Any]) -> dict[str, PlainTensor]:
        """Every parameter and buffer of the model parts that is no DTensor, bound in the module
        inside DDP / ``torch.compile`` wrappers (``frameworks.plain``)."""
        return module_plain_tensors(model_parts(state.get("model")) or (), self.strip_module)

    def describe(self, state: Mapping[str, Any]) -> StateDescription | None:
        parts = _parts_of(state)
        optim = optimizer_of(state)
        if parts is None:
            return None
        memo = BoxMemo()
        model: list[Piece] = []
        names: dict[int, str] = {}
        seen: dict[str, int] = {}  # checkpoint key -> the part that named it
        for i, (key, module) in enumerate(parts):
            self.check(module)
            buffers = {id(b) for b in module.buffers()}
            source = buffer_source(module) if buffers else None
            prefix = part_prefix(key)
            with torch.no_grad():
                for fqn, t in model_tensors(module, self.strip_module):
                    if seen.setdefault(prefix + fqn, i) != i:
                        raise FrameworkError(
                            f"two model parts of state[{key!r}] (numbers {seen[prefix + fqn]} and {i}) both name "
                            f"{fqn!r}; the parts of a model must have distinct parameter and buffer names"
                        )
                    model.append(tensor_piece(prefix + fqn, t, source if id(t) in buffers else None, memo))
            names.update({pid: part_name(key, fqn) for pid, fqn in param_fqns(module, self.strip_module).items()})
        prefixes = tuple(dict.fromkeys(part_prefix(key) for key, _ in parts))
        mesh = next((m for _, module in parts if (m := _mesh_of(module))), ())
        if optim is None:
            return StateDescription(tuple(model), None, mesh, prefixes)
        params: dict[int, ParamState] = {}
        for gi, g in enumerate(optim.param_groups):
            for p in g["params"]:
                if id(p) not in names:
                    raise FrameworkError(
                        f"optimizer param group {gi} holds a parameter (shape {tuple(p.shape)}) that is not in the "
                        "model: no module in the state owns it; every parameter an optimizer updates must be a "
                        "parameter of a module in the state (state['model'] or another module key)"
                    )
                params[id(p)] = TensorState(names[id(p)], p, memo)
        return StateDescription(tuple(model), OptimizerDescription(optim, params), mesh, prefixes)


def _parts_of(state: Mapping[str, Any]) -> list[tuple[str, nn.Module]] | None:
    """The (state key, module) parts of ``state["model"]`` (None: no model)."""
    model = state.get("model")
    if model is None:
        return None
    parts = model_parts(model)
    if parts is None:
        raise FrameworkError(
            f'state["model"] must be an nn.Module or a list of them (model parts), got {type(model).__name__}'
        )
    return parts


def _any_module(state: Mapping[str, Any], test: Callable[[nn.Module], bool]) -> bool:
    parts = model_parts(state.get("model"))
    return parts is not None and any(test(m) for _, m in parts)


class TorchAdapter(ModuleAdapter):
    name = "torch"


class DDPAdapter(ModuleAdapter):
    name = "ddp"

    def matches(self, state: Mapping[str, Any]) -> bool:
        return _any_module(state, lambda m: _ddp_of(m) is not None)


class FSDP2Adapter(ModuleAdapter):
    name = "fsdp2"

    def matches(self, state: Mapping[str, Any]) -> bool:
        fsdp = fsdp_package()
        return fsdp is not None and _any_module(
            state, lambda model: any(isinstance(m, fsdp.FSDPModule) for m in model.modules())
        )


class DTensorAdapter(ModuleAdapter):
    name = "dtensor"

    def matches(self, state: Mapping[str, Any]) -> bool:
        return _any_module(state, lambda model: any(isinstance(p, DTensor) for p in model.parameters()))
