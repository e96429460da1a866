"""``RestoreOptions(resize_plain_tensors=True)``: a plain tensor of the job whose saved shape
differs from its live shape (a buffer the model grew while it trained) takes the saved tensor,
as ``nn.Module.load_state_dict`` hands a model every saved tensor. Plain: what the adapter's
``plain_tensors`` names (``frameworks.plain``; the adapters own their types): a parameter or
buffer of a module loaded by the generic adapters (``torch``, ``ddp``, ``fsdp2``, ``dtensor``)
that is no DTensor, or an entry of ``FlatTensors``. Sharded tensors (DTensors, FSDP1 flat
parameters, Megatron's) and optimizer state keep the load's ``ShapeMismatchError``.

Who calls what, in order, on every rank of one load (``engine.load.pipeline``), on the metadata
that load already read (no second read):

  validate  ``plan_resizes``: for each such destination, the data files are checked to hold every
            byte of the saved tensor (``engine.load.data_files``; the metadata's decoder already checked
            that its shards tile the saved shape, each shard's byte length its box's size), and
            only then a fresh tensor of the saved shape (the live dtype and device) replaces the
            destination in the view; nothing in the job changes.
  read      the fresh tensors are read and verified like every other destination.
  apply     ``Resizes.apply``, first: each holder's ``install`` (``frameworks.plain``): each
            module gets its saved tensors through its own
            ``load_state_dict(values, strict=False)`` (the module that resizes there takes them;
            PyTorch's size-mismatch error, or a tensor left at another shape, is
            ``ResizeRefusedError``); each ``FlatTensors`` entry is rebound to its fresh tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...format.records import Metadata
from ...frameworks import FrameworkAdapter
from ...frameworks.plain import PlainTensor, TensorHolder
from ...planning.specs import LoadItem, ShardSpec
from ...storage import Storage
from .data_files import check_data_files

__all__ = ["Resizes", "plan_resizes", "NO_RESIZES"]


@dataclass(frozen=True, slots=True)
class _Resized:
    owner: PlainTensor
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
        holders: dict[int, tuple[TensorHolder, dict[str, torch.Tensor], dict[str, str]]] = {}
        for r in self.resized:
            _, values, fqns = holders.setdefault(id(r.owner.holder), (r.owner.holder, {}, {}))
            values[r.owner.name] = r.tensor
            fqns[r.owner.name] = r.fqn
        for holder, values, fqns in holders.values():
            holder.install(values, fqns)


NO_RESIZES = Resizes()


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
    owners = adapter.plain_tensors(framework_state)
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
