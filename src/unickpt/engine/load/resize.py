"""``RestoreOptions(resize_plain_tensors=True)``: a plain tensor of the job whose saved shape
differs from its live shape (a buffer the model grew while it trained) takes the saved tensor,
as ``nn.Module.load_state_dict`` hands a model every saved tensor. Plain: a parameter or buffer
of a module loaded by the generic adapters (``torch``, ``ddp``, ``fsdp2``, ``dtensor``) that is
no DTensor, or an entry of ``FlatTensors``. Sharded tensors (DTensors, FSDP1 flat parameters,
Megatron's) and optimizer state keep the load's ``ShapeMismatchError``.

Who calls what, in order, on every rank of one load (``engine.load.pipeline``), on the metadata
that load already read (no second read):

  validate  ``plan_resizes``: for each such destination, the data files are checked to hold every
            byte of the saved tensor (``engine.load.data_files``; the metadata's decoder already checked
            that its shards tile the saved shape, each shard's byte length its box's size), and
            only then a fresh tensor of the saved shape (the live dtype and device) replaces the
            destination in the view; nothing in the job changes.
  read      the fresh tensors are read and verified like every other destination.
  apply     ``Resizes.apply``, first: each module gets its saved tensors through its own
            ``load_state_dict(values, strict=False)`` (the module that resizes there takes them;
            PyTorch's size-mismatch error, or a tensor left at another shape, is
            ``ResizeRefusedError``); each ``FlatTensors`` entry is rebound to its fresh tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ...errors import ResizeRefusedError
from ...format.records import Metadata
from ...frameworks import FrameworkAdapter
from ...frameworks.flat import FlatTensors, FlatTensorsAdapter
from ...frameworks.generic import ModuleAdapter
from ...frameworks.module_state import clean_fqn
from ...frameworks.parts import MODEL_KEY, model_parts, part_prefix
from ...planning.specs import LoadItem, ShardSpec
from ...storage import Storage
from .data_files import check_data_files

__all__ = ["Resizes", "plan_resizes", "NO_RESIZES"]


@dataclass(frozen=True, slots=True)
class _Owner:
    """Where a plain live tensor is bound: ``holder[name]`` (a module's ``state_dict`` key, or a
    ``FlatTensors`` key)."""

    holder: nn.Module | FlatTensors
    name: str
    live: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Resized:
    owner: _Owner
    fqn: str
    tensor: torch.Tensor  # fresh, of the saved shape, filled by the read stage


class Resizes:
    """The tensors one load resizes; ``apply`` makes them the live ones (see the module docstring)."""

    def __init__(self, resized: tuple[_Resized, ...] = ()) -> None:
        self.resized = resized

    def __bool__(self) -> bool:
        return bool(self.resized)

    def apply(self) -> None:
        """The first step of the load's apply stage (after every byte was read and verified)."""
        modules: dict[int, tuple[nn.Module, dict[str, torch.Tensor], dict[str, str]]] = {}
        for r in self.resized:
            holder = r.owner.holder
            if isinstance(holder, FlatTensors):
                holder[r.owner.name] = r.tensor
            else:
                _, values, fqns = modules.setdefault(id(holder), (holder, {}, {}))
                values[r.owner.name] = r.tensor
                fqns[r.owner.name] = r.fqn
        for module, values, fqns in modules.values():
            _load_through_module(module, values, fqns)


NO_RESIZES = Resizes()


def _load_through_module(module: nn.Module, values: dict[str, torch.Tensor], fqns: dict[str, str]) -> None:
    """``module.load_state_dict(values, strict=False)``; ``ResizeRefusedError`` when it refuses a
    shape or leaves a tensor at another shape than the saved one."""
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


def plan_resizes(
    md: Metadata,
    storage: Storage,
    framework_state: Mapping[str, Any],
    adapter: FrameworkAdapter,
    items: list[LoadItem],
    rank: int,
) -> Resizes:
    """Replace in ``items`` each live plain destination whose saved shape differs by a fresh
    tensor of the saved shape, after checking the data files hold it; the validate stage calls
    it (nothing in the job changes). Other mismatches stay for ``check_targets`` to refuse."""
    differ = [
        i
        for i, it in enumerate(items)
        if not it.fresh
        and _whole(it.spec)
        and (rec := md.tensors.get(it.spec.fqn)) is not None
        and tuple(rec.shape) != tuple(it.spec.global_shape)
    ]
    if not differ:
        return NO_RESIZES
    owners = _plain_owners(framework_state, adapter)
    chosen = []
    for i in differ:
        owner = owners.get(items[i].spec.fqn)
        if owner is not None and tuple(owner.live.shape) == items[i].spec.global_shape:
            chosen.append((i, owner))
    fqns = [items[i].spec.fqn for i, _ in chosen]  # their files checked before allocating anything
    check_data_files(storage, md, fqns, prefix=f"rank {rank}: ", purpose=", to be resized to its saved shape")
    resized = []
    for i, owner in chosen:
        old = items[i].spec
        shape = tuple(md.tensors[old.fqn].shape)
        fresh = torch.empty(shape, dtype=owner.live.dtype, device=owner.live.device)
        items[i] = LoadItem(
            ShardSpec(old.fqn, old.dtype, shape, (0,) * len(shape), shape, old.replica_source), fresh, True
        )
        resized.append(_Resized(owner, old.fqn, fresh))
    return Resizes(tuple(resized))


def _whole(spec: ShardSpec) -> bool:
    """Whether a destination is its whole tensor (not a shard of it)."""
    return all(o == 0 for o in spec.offsets) and tuple(spec.lengths) == tuple(spec.global_shape)


def _plain_owners(framework_state: Mapping[str, Any], adapter: FrameworkAdapter) -> dict[str, _Owner]:
    """Checkpoint key -> where its plain live tensor is bound, for the adapters that load plain
    tensors as they are (named as their ``describe`` names them)."""
    model = framework_state.get(MODEL_KEY)
    if isinstance(adapter, FlatTensorsAdapter) and isinstance(model, FlatTensors):
        return {k: _Owner(model, k, t) for k, t in model.items()}
    if not isinstance(adapter, ModuleAdapter):
        return {}
    out: dict[str, _Owner] = {}
    for key, module in model_parts(model) or ():
        inner = _unwrapped(module)
        prefix = part_prefix(key)
        for raw, t in inner.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                out[prefix + clean_fqn(raw, adapter.strip_module)] = _Owner(inner, raw, t)
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
