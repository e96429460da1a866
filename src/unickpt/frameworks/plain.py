"""Plain live tensors an adapter loads as they are, for ``RestoreOptions(resize_plain_tensors=True)``:
where each is bound (``PlainTensor``) and how tensors of another shape are put there
(``TensorHolder.install``). The adapters own their types: ``generic.ModuleAdapter`` and
``flat.FlatTensorsAdapter`` answer ``plain_tensors(state)`` with the helpers below; every other
adapter answers none (``views.DescribedAdapter``), so its tensors keep the load's
``ShapeMismatchError``.

Who calls what: the load's validate stage (``engine.load.resize.plan_resizes``) asks the
adapter's ``plain_tensors`` which destinations may take the saved shape; its apply stage
(``engine.load.resize.Resizes.apply``) calls each holder's ``install`` once, with every resized
tensor of that holder.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..errors import ResizeRefusedError
from .module_state import clean_fqn
from .parts import part_prefix

__all__ = ["TensorHolder", "PlainTensor", "ModuleHolder", "FlatHolder", "module_plain_tensors", "flat_plain_tensors"]


class TensorHolder(Protocol):
    """What holds plain live tensors by name (a module's ``state_dict`` keys, a ``FlatTensors``)."""

    def install(self, values: dict[str, torch.Tensor], fqns: dict[str, str]) -> None:
        """Make ``values`` (name -> a tensor of the saved shape) the live tensors; ``fqns``: name
        -> its checkpoint key, for messages. ``ResizeRefusedError`` when the holder refuses."""


@dataclass(frozen=True, slots=True)
class PlainTensor:
    """A plain live tensor bound at ``holder``'s ``name``; one holder object per module or
    ``FlatTensors``, shared by all its tensors (the apply stage groups by it)."""

    holder: TensorHolder
    name: str
    live: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class ModuleHolder:
    """A module whose parameters and buffers are loaded through its own ``load_state_dict``, as
    PyTorch's and Hugging Face's loads hand it every saved tensor (a module that resizes there
    takes them)."""

    module: nn.Module

    def install(self, values: dict[str, torch.Tensor], fqns: dict[str, str]) -> None:
        """``module.load_state_dict(values, strict=False)``; ``ResizeRefusedError`` when it
        refuses a shape or leaves a tensor at another shape than the saved one."""
        module = self.module
        named = ", ".join(sorted(fqns.values()))
        try:
            with torch.no_grad():
                module.load_state_dict(values, strict=False)
        except RuntimeError as e:
            raise ResizeRefusedError(
                f"the saved shape of {named} differs from the live one and {type(module).__name__}.load_state_dict "
                f"refused it (RestoreOptions(resize_plain_tensors=True)): {e}"
            ) from e
        now = module.state_dict(keep_vars=True)
        kept = [
            f"{fqns[n]}: checkpoint shape {tuple(v.shape)}, live shape {tuple(now[n].shape)}"
            for n, v in values.items()
            if n in now and isinstance(now[n], torch.Tensor) and tuple(now[n].shape) != tuple(v.shape)
        ]
        if kept:
            raise ResizeRefusedError(
                f"{type(module).__name__}.load_state_dict kept another shape than the checkpoint's "
                "(RestoreOptions(resize_plain_tensors=True)): " + "; ".join(kept)
            )


@dataclass(frozen=True, slots=True, eq=False)
class FlatHolder:
    """A ``FlatTensors`` (any mutable mapping of tensors): each entry is rebound to its new tensor."""

    tensors: MutableMapping[str, torch.Tensor]

    def install(self, values: dict[str, torch.Tensor], fqns: dict[str, str]) -> None:
        for name, t in values.items():
            self.tensors[name] = t


def flat_plain_tensors(flat: MutableMapping[str, torch.Tensor]) -> dict[str, PlainTensor]:
    """Every entry of a ``FlatTensors``, under its own key."""
    holder = FlatHolder(flat)
    return {k: PlainTensor(holder, k, t) for k, t in flat.items()}


def module_plain_tensors(parts: Iterable[tuple[str, nn.Module]], strip_module: bool) -> dict[str, PlainTensor]:
    """Checkpoint key -> each parameter or buffer of the model parts that is no DTensor (named as
    ``generic.ModuleAdapter.describe`` names them), bound in the unwrapped module."""
    out: dict[str, PlainTensor] = {}
    holders: dict[int, ModuleHolder] = {}  # one per module, also when two parts wrap the same one
    for key, module in parts:
        inner = _unwrapped(module)
        holder = holders.setdefault(id(inner), ModuleHolder(inner))
        prefix = part_prefix(key)
        for raw, t in inner.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                out[prefix + clean_fqn(raw, strip_module)] = PlainTensor(holder, raw, t)
    return out


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside DDP and ``torch.compile`` wrappers: the one whose ``load_state_dict`` a
    training loop's own load calls (Accelerate and the Trainer unwrap the same way)."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif isinstance(inner := getattr(module, "_orig_mod", None), nn.Module):
            module = inner
        else:
            return module
