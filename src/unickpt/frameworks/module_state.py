"""Generic translation of ``nn.Module`` and ``torch.optim.Optimizer`` state to shard items.

Used by the torch / ddp / fsdp2 / dtensor adapters (and, for the optimizer's param groups, by
FSDP1). A tensor that is a DTensor contributes the box of its local shard (any mesh, any
placements, including FSDP2+TP strided sharding); a plain tensor contributes the full box, and
identical boxes on several ranks are replicas (the save planner writes each once).
Checkpoint keys: ``model.<fqn>`` for parameters and persistent buffers,
``optimizer.state.<param fqn>.<state name>`` for optimizer state tensors, and one JSON object
``optimizer`` with param groups (params named by fqn) and non-tensor state values.

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

from ..errors import CorruptMetadataError, FrameworkError, MissingKeysError, UnexpectedKeysError
from ..format.dtypes import dtype_name
from ..format.records import JSONValue
from ..format.values import decode_value, encode_value
from ..planning.specs import LoadItem, SaveItem, ShardSpec
from .base import OPTIM_PREFIX

__all__ = [
    "clean_fqn",
    "tensor_box",
    "local_tensor",
    "model_tensors",
    "param_fqns",
    "optimizer_save",
    "optimizer_load",
    "ensure_optimizer_state",
    "items_for",
    "ParamNames",
    "names_of",
    "optimizer_object",
    "optimizer_finish",
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


def items_for(fqn: str, t: torch.Tensor, make: Callable[[ShardSpec, torch.Tensor], Any]) -> Any:
    shape, offsets, lengths = tensor_box(t)
    spec = ShardSpec(fqn, dtype_name(t.dtype), shape, offsets, lengths)
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


def ensure_optimizer_state(optim: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None) -> None:
    """Materialise empty optimizer state (a fresh optimizer) so it can be loaded in place.

    Runs one step with zero gradients and learning rate 0, then drops the gradients; parameters
    are unchanged and the state's values are overwritten by the load. By default this happens
    only when the optimizer has no state at all (for every parameter); with ``params`` it
    happens for those of ``params`` that lack state (others get no gradient, so no update)."""
    if params is None:
        if optim.state:
            return
        params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    else:
        params = [p for p in params if p.requires_grad and not optim.state.get(p)]
        if not params:
            return
    every = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in every):
        raise FrameworkError("cannot initialise optimizer state: parameters already have gradients")
    saved_lrs = []
    for g in optim.param_groups:
        lr = g.get("lr")
        saved_lrs.append(lr)
        if isinstance(lr, torch.Tensor):
            g["lr"] = torch.zeros_like(lr)
        elif lr is not None:
            g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, saved_lrs):
            if lr is not None:
                g["lr"] = lr
        optim.zero_grad(set_to_none=True)


def optimizer_load(
    optim: torch.optim.Optimizer,
    names: dict[int, str],
    describe: Callable[[str, torch.Tensor, torch.Tensor], Iterable[LoadItem]],
) -> tuple[list[LoadItem], Callable[[Mapping[str, JSONValue], bool], list[str]]]:
    """Destinations for the optimizer's state tensors, and the finisher applying param groups."""
    ensure_optimizer_state(optim)
    items: list[LoadItem] = []
    for g in optim.param_groups:
        for p in g["params"]:
            for key, v in optim.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    items.extend(describe(f"{OPTIM_PREFIX}state.{names[id(p)]}.{key}", v, p))
    return items, optimizer_finish(optim, names)


def optimizer_finish(
    optim: torch.optim.Optimizer, names: ParamNames
) -> Callable[[Mapping[str, JSONValue], bool], list[str]]:
    """The load finisher: applies the checkpoint's param groups and non-tensor state values."""

    def finish(objects: Mapping[str, JSONValue], strict: bool) -> list[str]:
        raw = objects.get("optimizer")
        if raw is None:
            if strict:
                raise MissingKeysError("checkpoint has no optimizer param groups ('optimizer' object)")
            return ["optimizer"]
        saved = _checked_optimizer_object(decode_value(raw, "optimizer object"))
        _apply_param_groups(optim, names, saved["param_groups"], strict)
        by_name = {n: p for g in optim.param_groups for p in g["params"] for n in names_of(names, p)}
        for pname, vals in saved.get("state_values", {}).items():
            if pname in by_name:
                optim.state[by_name[pname]].update(vals)
        return []

    return finish


def _checked_optimizer_object(saved: Any) -> dict[str, Any]:
    """The decoded ``optimizer`` object, or CorruptMetadataError if its structure is wrong."""

    def bad(what: str) -> CorruptMetadataError:
        return CorruptMetadataError(f"checkpoint metadata object 'optimizer' is malformed: {what}")

    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise bad("expected a dict with a 'param_groups' list")
    for gi, g in enumerate(saved["param_groups"]):
        if (
            not isinstance(g, dict)
            or not isinstance(g.get("params"), list)
            or not all(isinstance(p, str) for p in g["params"])
        ):
            raise bad(f"param group {gi} must be a dict with a 'params' list of names")
        for k, v in g.items():
            if k != "params" and not isinstance(v, (type(None), bool, int, float, str, tuple, list, torch.Tensor)):
                raise bad(f"param group {gi} entry {k!r} has type {type(v).__name__}")
    values = saved.get("state_values", {})
    if not isinstance(values, dict) or not all(isinstance(v, dict) for v in values.values()):
        raise bad("'state_values' must map parameter names to dicts")
    return saved


def _apply_param_groups(
    optim: torch.optim.Optimizer, names: ParamNames, saved_groups: list[dict[str, Any]], strict: bool
) -> None:
    live = _group_entries(optim, names)
    if len(live) != len(saved_groups):
        raise UnexpectedKeysError(f"optimizer has {len(live)} param group(s), checkpoint has {len(saved_groups)}")
    for gi, (g, lg, sg) in enumerate(zip(optim.param_groups, live, saved_groups)):
        if strict and set(lg["params"]) != set(sg["params"]):
            extra = sorted(set(lg["params"]) - set(sg["params"]))[:5]
            miss = sorted(set(sg["params"]) - set(lg["params"]))[:5]
            raise MissingKeysError(
                f"optimizer param group {gi} differs: live-only params {extra}, checkpoint-only {miss}"
            )
        for k, v in sg.items():
            if k == "params":
                continue
            cur = g.get(k)
            if cur is not None and isinstance(cur, (int, float, bool, torch.Tensor)) != isinstance(
                v, (int, float, bool, torch.Tensor)
            ):
                raise CorruptMetadataError(
                    f"optimizer param group {gi} entry {k!r}: checkpoint value {v!r} does not fit {cur!r}"
                )
            if isinstance(cur, torch.Tensor) and not isinstance(v, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple) and isinstance(v, list):
                g[k] = tuple(v)
            else:
                g[k] = v
