"""Generic translation of ``nn.Module`` and ``torch.optim.Optimizer`` state to shard items.

Used by the torch / ddp / fsdp2 / dtensor adapters (and, for the optimizer's param groups, by
FSDP1). A tensor that is a DTensor contributes the box of its local shard (any mesh, any
placements, including FSDP2+TP strided sharding); a plain tensor contributes the full box, and
identical boxes on several ranks are replicas (the save planner writes each once).
Checkpoint keys: ``model.<fqn>`` for parameters and persistent buffers,
``optimizer.state.<param fqn>.<state name>`` for optimizer state tensors, and one JSON object
``optimizer`` with param groups (params named by fqn: the parameters the optimizer covers, with
or without state) and non-tensor state values. Loading optimizer state is ``optim_state``'s.

Parameter names (``ParamNames``) map ``id(param)`` to its clean fqn, or to a tuple of clean fqns
when one live parameter stands for several original ones (an FSDP1 FlatParameter); groups and
non-tensor state are then written per original fqn, so every framework reads the same object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import FrameworkError
from ..format.dtypes import dtype_name
from ..format.records import JSONValue
from ..format.values import encode_value
from ..planning.specs import LoadItem, SaveItem, ShardSpec
from .base import OPTIM_PREFIX

__all__ = [
    "clean_fqn",
    "tensor_box",
    "local_tensor",
    "model_tensors",
    "param_fqns",
    "optimizer_save",
    "items_for",
    "ParamNames",
    "names_of",
    "optimizer_object",
    "refuse_meta",
]

# id(param) -> clean fqn, or the clean fqns of the original parameters a flat parameter holds
ParamNames = Mapping[int, str | tuple[str, ...]]

_WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def clean_fqn(fqn: str, strip_module: bool) -> str:
    """Drop wrapper segments (DDP's ``module.``, torch.compile's ``_orig_mod.``, FSDP1/activation
    checkpoint wrappers) so every framework names a parameter the same way."""
    parts = fqn.split(".")
    drop = set(_WRAPPER_PARTS) if strip_module else set(_WRAPPER_PARTS) - {"module"}
    out = [p for p in parts if p not in drop or p.startswith("_flat_param")]
    return ".".join(out)


def tensor_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, offsets, lengths) of the part of ``t`` held by this rank."""
    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()
        if len(chunks) != 1:
            raise FrameworkError(f"DTensor with {len(chunks)} local chunks is not supported")
        return tuple(t.shape), tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    shape = tuple(t.shape)
    return shape, (0,) * len(shape), shape


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local data of ``t`` as a plain tensor sharing its storage (writes go to ``t``)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.detach()


def items_for(
    fqn: str, t: torch.Tensor, make: Callable[[ShardSpec, torch.Tensor], Any], replica_source: int | None = None
) -> Any:
    """The item of ``t``'s local box (``replica_source``: see ``ShardSpec``)."""
    shape, offsets, lengths = tensor_box(t)
    spec = ShardSpec(fqn, dtype_name(t.dtype), shape, offsets, lengths, replica_source)
    loc = local_tensor(t)
    if tuple(loc.shape) != lengths:
        raise FrameworkError(f"{fqn}: local tensor shape {tuple(loc.shape)} != shard lengths {lengths}")
    return make(spec, loc)


def model_tensors(module: nn.Module, strip_module: bool) -> list[tuple[str, torch.Tensor]]:
    """(clean fqn, tensor) for parameters and persistent buffers, as ``state_dict`` lists them."""
    out = []
    seen: dict[str, str] = {}
    with torch.no_grad():
        for raw, t in module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                raise FrameworkError(f"model state {raw!r} is not a tensor ({type(t).__name__})")
            fqn = clean_fqn(raw, strip_module)
            if fqn in seen:
                raise FrameworkError(f"model keys {seen[fqn]!r} and {raw!r} both map to {fqn!r}")
            seen[fqn] = raw
            out.append((fqn, t))
    return out


def param_fqns(module: nn.Module, strip_module: bool) -> dict[int, str]:
    """id(parameter) -> clean fqn, for naming optimizer state."""
    return {id(p): clean_fqn(n, strip_module) for n, p in module.named_parameters()}


def names_of(names: ParamNames, p: torch.Tensor) -> tuple[str, ...]:
    """The clean fqn(s) ``names`` gives parameter ``p`` (several for a flat parameter)."""
    n = names[id(p)]
    return (n,) if isinstance(n, str) else tuple(n)


def _group_entries(optim: torch.optim.Optimizer, names: ParamNames) -> list[dict[str, Any]]:
    groups = []
    for gi, g in enumerate(optim.param_groups):
        params: list[str] = []
        for p in g["params"]:
            if id(p) not in names:
                raise FrameworkError(f"optimizer param group {gi} holds a parameter that is not in the model")
            params.extend(names_of(names, p))
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = params
        groups.append(entry)
    return groups


def optimizer_save(
    optim: torch.optim.Optimizer,
    names: dict[int, str],
    describe: Callable[[str, torch.Tensor, torch.Tensor], Iterable[SaveItem]],
) -> tuple[list[SaveItem], dict[str, JSONValue]]:
    """Items for every optimizer state tensor and the ``optimizer`` JSON object.

    ``describe(fqn, state_tensor, param)`` yields the SaveItems of one state tensor (adapters with
    their own layout, like FSDP1 flat parameters, pass their own)."""
    items: list[SaveItem] = []
    values: dict[str, dict[str, Any]] = {}
    for g in optim.param_groups:
        for p in g["params"]:
            st = optim.state.get(p)
            if not st:
                continue
            pname = names[id(p)]
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    items.extend(describe(f"{OPTIM_PREFIX}state.{pname}.{key}", v, p))
                else:
                    values.setdefault(pname, {})[key] = v
    return items, optimizer_object(optim, names, values)


def optimizer_object(
    optim: torch.optim.Optimizer, names: ParamNames, values: Mapping[str, Mapping[str, Any]]
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
