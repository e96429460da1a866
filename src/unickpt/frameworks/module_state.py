"""Generic pieces of ``nn.Module`` and optimizer state, and the ``optimizer`` JSON object.

Used by every adapter's ``describe`` (``generic``; ``fsdp1`` for parameters FSDP does not
manage) and by ``views.save_view``. A tensor that is a DTensor contributes the box of its local
shard (any mesh, any placements, including FSDP2+TP strided sharding); a plain tensor
contributes the full box, and identical boxes on several ranks are replicas (the save planner
writes each once). Checkpoint keys: ``model.<fqn>`` for parameters and persistent buffers,
``optimizer.state.<param fqn>.<state name>`` for optimizer state tensors, and one JSON object
``optimizer`` with param groups (params named by fqn: the parameters the optimizer covers, with
or without state) and non-tensor state values. Loading optimizer state is ``optim_state``'s.

Parameter names (``ParamNames``) map ``id(param)`` to the clean fqns of the original parameters
it stands for (several: an FSDP1 FlatParameter); groups and non-tensor state are written per
original fqn, so every framework reads the same object.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import FrameworkError
from ..format.dtypes import dtype_name
from ..format.records import JSONValue
from ..format.values import encode_value
from ..planning.specs import LoadItem, SaveItem, Shape, ShardSpec
from ._fsdp_internals import WRAPPER_SEGMENTS, dtensor_local, dtensor_local_box
from .base import STATE_PREFIX, OptimizerDescription, OptimizerLike, Piece, Role, is_optimizer_like

__all__ = [
    "clean_fqn",
    "tensor_box",
    "local_tensor",
    "BoxMemo",
    "tensor_piece",
    "model_tensors",
    "param_fqns",
    "ParamNames",
    "names_of",
    "TensorState",
    "optimizer_save",
    "optimizer_object",
    "refuse_meta",
    "module_of",
    "optimizer_of",
]

# id(param) -> the clean fqns of the original parameters it stands for
ParamNames = Mapping[int, tuple[str, ...]]


_DROP = frozenset(WRAPPER_SEGMENTS)
_DROP_MODULE = _DROP | {"module"}


def clean_fqn(fqn: str, strip_module: bool) -> str:
    """Drop wrapper segments (DDP's ``module.``, torch.compile's ``_orig_mod.``, FSDP1/activation
    checkpoint wrappers) so every framework names a parameter the same way."""
    parts = fqn.split(".")
    drop = _DROP_MODULE if strip_module else _DROP
    if drop.isdisjoint(parts):
        return fqn
    return ".".join(p for p in parts if p not in drop or p.startswith("_flat_param"))


def tensor_box(t: torch.Tensor) -> tuple[Shape, Shape, Shape]:
    """(global shape, offsets, lengths) of the part of ``t`` held by this rank."""
    if isinstance(t, DTensor):
        return (tuple(t.shape), *dtensor_local_box(t))
    shape = tuple(t.shape)
    return shape, (0,) * len(shape), shape


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local data of ``t`` as a plain tensor sharing its storage (writes go to ``t``)."""
    if isinstance(t, DTensor):
        t = dtensor_local(t)
    return t.detach()


class BoxMemo:
    """The boxes one description has computed, by layout, so that tensors of one layout (a
    model's parameters and their optimizer state share a handful) pay for it once.

    A DTensor's local box is a function of its global shape, device mesh and placements (and
    of this process's coordinate in the mesh, fixed for the process): torch's
    ``__create_chunk_list__`` costs ~30 us a call, a memo hit ~1 us and is the box torch would
    compute. A DTensor whose local tensor is itself chunked (torch then asks that tensor) is
    never memoised. A plain tensor's box is its full shape. Specs built from a memoised box
    skip ``ShardSpec``'s check (``ShardSpec.checked_box``): the first spec of that box made it.
    Owned by one ``describe`` call (``ModuleAdapter.describe`` creates it and hands it to its
    ``TensorState``s)."""

    __slots__ = ("dtensors", "plain")

    def __init__(self) -> None:
        self.dtensors: dict[tuple[Any, Any, Any], tuple[Shape, Shape, Shape]] = {}
        self.plain: dict[Shape, tuple[Shape, Shape, Shape]] = {}


def tensor_piece(key: str, t: torch.Tensor, replica_source: int | None = None, memo: BoxMemo | None = None) -> Piece:
    """The piece of ``t``'s local box under checkpoint key ``key`` (``replica_source``: see
    ``ShardSpec``); ``memo``: boxes already computed by this description (``BoxMemo``)."""
    loc = local_tensor(t)
    if memo is None or (isinstance(t, DTensor) and hasattr(loc, "__create_chunk_list__")):
        box = tensor_box(t)
        spec = ShardSpec(key, dtype_name(t.dtype), *box, replica_source)
    else:
        if isinstance(t, DTensor):
            table: dict[Any, tuple[Shape, Shape, Shape]] = memo.dtensors
            layout: Any = (t.shape, t.device_mesh, t.placements)
        else:
            table, layout = memo.plain, t.shape
        known = table.get(layout)
        if known is None:
            box = tensor_box(t)
            spec = ShardSpec(key, dtype_name(t.dtype), *box, replica_source)  # checks the box
            table[layout] = box
        else:
            spec = ShardSpec.checked_box(key, dtype_name(t.dtype), *known, replica_source)
    if loc.shape != spec.lengths:
        raise FrameworkError(f"{key}: local tensor shape {tuple(loc.shape)} != shard lengths {spec.lengths}")
    return Piece(spec, loc)


def model_tensors(module: nn.Module, strip_module: bool) -> list[tuple[str, torch.Tensor]]:
    """(clean fqn, tensor) for parameters and persistent buffers, as ``state_dict`` lists them
    (a module's ``_extra_state`` of None is skipped; any other non-tensor entry is refused)."""
    out = []
    seen: dict[str, str] = {}
    with torch.no_grad():
        for raw, t in module.state_dict(keep_vars=True).items():
            if t is None and raw.rsplit(".", 1)[-1] == "_extra_state":
                continue  # get_extra_state() gave None (megatron's local layers): nothing to keep
            if not isinstance(t, torch.Tensor):
                raise FrameworkError(f"model state {raw!r} is not a tensor ({type(t).__name__})")
            fqn = clean_fqn(raw, strip_module)
            if fqn in seen:
                raise FrameworkError(f"model keys {seen[fqn]!r} and {raw!r} both map to {fqn!r}")
            seen[fqn] = raw
            out.append((fqn, t))
    return out


def check_loads_in_place(key: str, module: nn.Module) -> None:
    """``FrameworkError`` when ``module.state_dict()`` lists a tensor that is none of the module's
    parameters or buffers: a state-dict hook built it (a fused weight split into new tensors, a
    dtype cast ...). The generic adapters load in place into the tensors ``state_dict`` lists, so
    values loaded into such a tensor would be dropped with it and the module left unchanged: the
    load is refused instead (a module's ``_extra_state`` is left to ``get_extra_state``, as before).
    Called by ``ModuleAdapter.load_view`` for each model part, before anything is read."""
    held = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    with torch.no_grad():
        loose = [
            raw
            for raw, t in module.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and id(t) not in held and raw.rsplit(".", 1)[-1] != "_extra_state"
        ]
    if loose:
        raise FrameworkError(
            f"state[{key!r}]: state_dict() lists {len(loose)} tensor(s) that are not the module's own parameters "
            f"or buffers (e.g. {loose[0]!r}; a state-dict hook builds them): unickpt loads in place, so their "
            "loaded values would be lost; remove or pause the hook while loading (the torchtitan integration "
            "does), or load into a module without it"
        )


def param_fqns(module: nn.Module, strip_module: bool) -> dict[int, str]:
    """id(parameter) -> clean fqn, for naming optimizer state."""
    return {id(p): clean_fqn(n, strip_module) for n, p in module.named_parameters()}


def names_of(names: ParamNames, p: torch.Tensor) -> tuple[str, ...]:
    """The clean fqn(s) ``names`` gives parameter ``p`` (several for a flat parameter)."""
    return names[id(p)]


@dataclass(frozen=True, eq=False)
class TensorState:
    """``ParamState`` of a parameter that says which box it holds (plain tensor, DTensor):
    its state is laid out like the parameter itself."""

    fqn: str
    param: torch.Tensor
    memo: BoxMemo | None = field(default=None, repr=False)  # the describing call's (``BoxMemo``)

    @property
    def fqns(self) -> tuple[str, ...]:
        return (self.fqn,)

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return (tuple(self.param.shape),)

    @property
    def holds(self) -> bool:
        return True  # even an empty local shard of a DTensor gets a gradient, hence state

    def like(self) -> tuple[torch.Tensor, bool]:
        return self.param, False

    def pieces(self, name: str, value: torch.Tensor) -> list[Piece]:
        return [tensor_piece(f"{STATE_PREFIX}{self.fqn}.{name}", value, None, self.memo)]


def _group_entries(optim: OptimizerLike, names: ParamNames) -> list[dict[str, Any]]:
    groups = []
    for g in optim.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = [f for p in g["params"] for f in names_of(names, p)]
        groups.append(entry)
    return groups


def optimizer_save(desc: OptimizerDescription) -> tuple[list[SaveItem], dict[str, JSONValue]]:
    """Items for every optimizer state tensor and the ``optimizer`` JSON object."""
    optim = desc.optimizer
    items: list[SaveItem] = []
    values: dict[str, dict[str, Any]] = {}
    with torch.no_grad():  # pieces are detached views; to_local() is no autograd op then
        for g in optim.param_groups:
            for p in g["params"]:
                st = optim.state.get(p)
                if not st:
                    continue
                ps = desc.params[id(p)]
                for key, v in st.items():
                    if isinstance(v, torch.Tensor):
                        pieces = ps.pieces(key, v)
                        items.extend(SaveItem(pc.spec, pc.tensor) for pc in pieces if pc.role is not Role.ELSEWHERE)
                    else:
                        for fqn in ps.fqns:
                            values.setdefault(fqn, {})[key] = v
    return items, optimizer_object(optim, desc.names(), values)


def optimizer_object(
    optim: OptimizerLike, names: ParamNames, values: Mapping[str, Mapping[str, Any]]
) -> dict[str, JSONValue]:
    """The ``optimizer`` JSON object: param groups (params by clean fqn) and the non-tensor
    state ``values`` (clean param fqn -> state name -> value)."""
    obj = {"param_groups": _group_entries(optim, names), "state_values": {k: dict(v) for k, v in values.items()}}
    return {"optimizer": encode_value(obj, "optimizer")}


def refuse_meta(items: Iterable[SaveItem | LoadItem], saving: bool) -> None:
    """FrameworkError naming the first item on the meta device (no data: a save would fail deep
    in a copy, a load would silently write nothing)."""
    for it in items:
        if it.tensor.is_meta:
            if saving:
                raise FrameworkError(
                    f"cannot save {it.spec.fqn!r}: it is on the meta device (it has no values yet); "
                    "materialise the model first: model.to_empty(device=...) and initialise its "
                    "parameters (e.g. reset_parameters()) or load a checkpoint into it"
                )
            raise FrameworkError(
                f"cannot load into {it.spec.fqn!r}: it is on the meta device, so the load would write "
                "nothing; call model.to_empty(device=...) first (then build the optimizer), then load"
            )


def module_of(state: Mapping[str, Any]) -> nn.Module | None:
    """``state["model"]`` (None if absent); FrameworkError if it is not an ``nn.Module``."""
    model = state.get("model")
    if model is not None and not isinstance(model, nn.Module):
        raise FrameworkError(f'state["model"] must be an nn.Module, got {type(model).__name__}')
    return model


def optimizer_of(state: Mapping[str, Any]) -> OptimizerLike | None:
    """``state["optimizer"]`` (None if absent): any optimizer-like object (``base``'s contract)."""
    optim = state.get("optimizer")
    if optim is None:
        return None
    if not is_optimizer_like(optim):
        raise FrameworkError(
            f'state["optimizer"] must be an optimizer: an object with param_groups (a list of dicts, each '
            f'with a "params" list) and state (a mutable mapping from parameter to its state dict), like '
            f"torch.optim.Optimizer; got {type(optim).__name__}"
        )
    if state.get("model") is None:
        raise FrameworkError('state["optimizer"] needs state["model"] to name its parameters')
    return optim  # type: ignore[no-any-return]
