"""The reference state of a model and its optimizer, gathered with torch's own APIs only.

``full_state(model, optim=None)`` returns every tensor of the model's ``state_dict``
(parameters and persistent buffers) and every tensor of the optimizer's per-parameter state, as
full, contiguous CPU tensors (clones, so later training does not change them). Collective for
sharded models: every rank of the model's process group must call it.

How each framework's state is gathered (no unickpt code is involved):
  * FSDP1 (``FullyShardedDataParallel`` anywhere in the model): FSDP's own
    ``state_dict_type(FULL_STATE_DICT)`` model state dict and ``FSDP.optim_state_dict`` (full,
    on every rank), which unflatten flat parameters and drop FSDP's wrapper names;
  * DDP: ``model.module``'s ``state_dict()``; ``torch.compile``: ``model._orig_mod``'s;
  * FSDP2 / tensor parallel (DTensor parameters and state): ``DTensor.full_tensor()``;
  * a plain module: its ``state_dict()``.

Canonical keys (written here, independently of unickpt, so that state from different
frameworks and world sizes compares key by key, and with a checkpoint's tensor list):
  * ``model.<fqn>``: a model state-dict entry;
  * ``optimizer.state.<fqn>.<name>``: optimizer state tensor ``<name>`` (``exp_avg``, ``step``,
    ``momentum_buffer``...) of parameter ``<fqn>``;
where ``<fqn>`` is the name in the user's module, without the segments the wrappers add (DDP's
``module.``, compile's ``_orig_mod.``, FSDP1's ``_fsdp_wrapped_module.`` and flat parameters).
Non-tensor optimizer state (rare: e.g. a Python number ``step``) is left out.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["full_state", "user_module"]


def full_state(model: nn.Module, optim: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """The full model (and optimizer) state under canonical keys; see the module docstring."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return _fsdp1_state(model, optim)
    module = user_module(model)
    out = {f"model.{k}": _full(v) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    if optim is None:
        return out
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optim.param_groups:
        for p in group["params"]:
            for name, v in optim.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"optimizer.state.{names[id(p)]}.{name}"] = _full(v)
    return out


def user_module(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / ``torch.compile`` wrappers (``model`` itself otherwise)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _full(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def _fsdp1_state(model: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        FullyShardedDataParallel,
        StateDictType,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP1's state_dict_type is deprecated
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.fsdp")
        with FullyShardedDataParallel.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
        ):
            msd = model.state_dict()
            osd = FullyShardedDataParallel.optim_state_dict(model, optim) if optim is not None else None
    out = {f"model.{k}": _full(v) for k, v in msd.items() if isinstance(v, torch.Tensor)}
    if osd is None:
        return out
    for fqn, per_param in osd["state"].items():
        for name, v in per_param.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer.state.{fqn}.{name}"] = _full(v)
    return out
