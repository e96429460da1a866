"""The layouts frameworks give PyTorch DCP checkpoints, mapped onto unickpt's keys, and back.

Every layout below is a DCP checkpoint (or a folder of them) whose entries DCP flattened into
dotted keys; this module finds the model, the optimizer (state *and* param groups) and the
training state among them by their structure, never by a top-level name alone.

Import layouts (``find_parts`` lists the DCP folders to read, ``map_import`` maps their entries):

* ``get_state_dict(model, optim)`` under any top-level names (``{"model", "optimizer"}``,
  ``{"model", "optim"}``, ``{"app": {"model", "optim"}}`` ...): the optimizer is the prefix ``P``
  with ``P.param_groups.<i>.params`` lists of parameter names and ``P.state.<fqn>.<name>``
  entries; the model is the prefix under which every one of those names is a tensor. Also
  Lightning's sharded FSDP folder (``{"model", "optimizer_0"}``, its ``meta.pt`` trainer state is
  a pickle: listed, not imported) and Accelerate's sharded folder (``pytorch_model_fsdp_0/`` with
  ``model.*``, ``optimizer_0/`` with ``optimizer.*``; its ``*.bin`` / ``*.pkl`` files: listed).
* torchtitan: model FQNs at the top level, ``optimizer`` flattened
  (``flatten_optimizer_state_dict``: ``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyper>``; the
  param groups are rebuilt from the parameters' equal hyper-parameters), ``lr_scheduler``,
  ``train_state`` (-> unickpt ``extra_state[<name>]``) and ``dataloader`` (-> unickpt's
  dataloader state of rank 0, which a loader with ``load_state_dict`` restores at world size 1).
* ByteCheckpoint: ``model/`` (the model's own FQNs) and ``optimizer/`` (``state.*``,
  ``param_groups.*``) folders, read as if prefixed ``model.`` / ``optimizer.``.
Param groups become unickpt's ``optimizer`` object (``{"param_groups": [{<hyper>..., "params":
[fqn...]}], "state_values": {fqn: {name: value}}}``, as ``frameworks.module_state`` saves it),
state tensors ``optimizer.state.<fqn>.<name>``, model tensors ``model.<fqn>``. Other tensors keep
their DCP key; other plain values go to ``extra_state[<top-level name>]``.

Export layouts (``export_state``; ``convert.to_dcp`` passes the result to ``dcp.save``):
``"state_dict"`` writes ``{"model": ..., "optimizer": {"state": ..., "param_groups": [...]}}``
exactly as ``get_state_dict`` lays them out (``dcp.load`` + ``set_state_dict`` restore it without
``allow_partial_load``), and every other state key (a ``Stateful`` such as ``"lr_scheduler"``,
a ``PerRank`` or plain value: rank 0's) under its own name, as ``dcp.save(state)`` writes a
``Stateful``; ``"torchtitan"`` writes model FQNs at the top level, the flattened ``optimizer``,
the ``extra_state`` entries, every other state key (``lr_scheduler``, ``train_state``) and the
``dataloader`` (every DP rank's ``dp_rank_<r>`` in one entry) under their names, as torchtitan's
DCP manager does (``_flattened_model_states_sd``), so it resumes from it.

Order of use: ``convert.from_dcp`` -> ``find_parts(folder)`` -> reads every part -> ``map_import``
-> saves ``Imported``; ``convert.to_dcp`` -> ``read_unickpt(path, role)`` -> ``export_state`` ->
``dcp.save``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ConfigurationError, NotACheckpointError
from .source_files import is_subfolder

__all__ = [
    "EXPORT_LAYOUTS",
    "DcpPart",
    "Imported",
    "SavedUnickpt",
    "find_parts",
    "map_import",
    "read_unickpt",
    "export_state",
    "ImportedLoaderState",
]

EXPORT_LAYOUTS = ("state_dict", "torchtitan")
_GROUPS, _STATE = "param_groups", "state"
_TRAINING = ("lr_scheduler", "train_state")  # torchtitan's training state: into extra_state
_LOADER = "dataloader"
_NESTED_PARAMS = re.compile(r"(\d{1,9})\.params")
_ACCELERATE = re.compile(r"(pytorch_model_fsdp|optimizer)_(\d{1,9})")


@dataclass(frozen=True, slots=True)
class DcpPart:
    """One DCP checkpoint folder to read, and the prefix its keys get (ByteCheckpoint's
    ``model/`` and ``optimizer/`` hold keys without one)."""

    folder: str
    prefix: str = ""


@dataclass(frozen=True, slots=True)
class Imported:
    """A DCP checkpoint in unickpt's terms (``convert`` saves it with ``framework="tensors"``)."""

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]  # {"optimizer": {"param_groups": [...], "state_values": {...}}} (not encoded)
    extra_state: dict[str, Any] | None
    dataloader: Any  # the DCP ``dataloader`` entries ({name: value}), or None
    skipped: tuple[str, ...]
    layout: str  # what was recognised, for the CLI's summary line


class ImportedLoaderState:
    """Carries imported dataloader state into ``unickpt.save`` (a loader with ``state_dict``)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


# ----------------------------------------------------------------------------- import


def find_parts(folder: str) -> tuple[list[DcpPart], list[str]]:
    """The DCP folders of ``folder`` and the entries not imported (with why): a DCP checkpoint
    itself (Lightning's ``meta.pt`` beside it listed), Accelerate's ``pytorch_model_fsdp_0/`` +
    ``optimizer_0/`` (other indices and its pickled files listed), or ByteCheckpoint's ``model/``
    + ``optimizer/``. CheckpointError for anything else."""
    if not os.path.isdir(folder):
        raise NotACheckpointError(f"no DCP checkpoint at {folder} (it is not a folder)")
    names = sorted(os.listdir(folder))
    if os.path.isfile(os.path.join(folder, ".metadata")):  # its files: checked by the reader
        skipped = [f"{n} (Lightning's trainer state: a pickle, not imported)" for n in names if n == "meta.pt"]
        return [DcpPart(folder)], skipped
    for n in names:  # a part of a layout that is a link (or not a folder) is refused, never followed
        if n in ("model", "optimizer") or _ACCELERATE.fullmatch(n):
            is_subfolder(folder, n)
    links = [n for n in names if os.path.islink(os.path.join(folder, n))]  # other links: listed, not followed
    names = [n for n in names if n not in links]
    linked = [f"{n} (a link: not followed)" for n in links]
    dcp_dirs = {n for n in names if os.path.isfile(os.path.join(folder, n, ".metadata"))}
    accelerate = {n: m for n in dcp_dirs if (m := _ACCELERATE.fullmatch(n))}
    if accelerate:
        parts = [DcpPart(os.path.join(folder, n)) for n, m in sorted(accelerate.items()) if m.group(2) == "0"]
        skipped = [
            f"{n} (a second model or optimizer: unickpt converts index 0)" for n, m in accelerate.items() if m[2] != "0"
        ]
        skipped += [f"{n} (not a DCP checkpoint: not imported)" for n in names if n not in accelerate]
        return parts, skipped + linked
    byte = [DcpPart(os.path.join(folder, p), f"{p}.") for p in ("model", "optimizer") if p in dcp_dirs]
    if byte:
        return byte, [f"{n}/ (not imported)" for n in names if n not in ("model", "optimizer")] + linked
    raise NotACheckpointError(
        f"{folder} is neither a DCP checkpoint (.metadata) nor a folder of DCP checkpoints (Accelerate's "
        "pytorch_model_fsdp_0/ and optimizer_0/, ByteCheckpoint's model/ and optimizer/)"
    )


@dataclass
class _Optimizer:
    prefix: str
    groups: list[dict[str, Any]] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # unickpt key -> tensor
    values: dict[str, dict[str, Any]] = field(default_factory=dict)  # fqn -> name -> value
    keys: set[str] = field(default_factory=set)  # the DCP keys it took
    flattened: bool = False  # torchtitan's param_groups.<fqn>.<hyper> (else get_state_dict's)

    def fqns(self) -> list[str]:
        return [f for g in self.groups for f in g["params"]]


def _head(prefix: str) -> str:
    return f"{prefix}." if prefix else ""


def _optimizer_prefixes(keys: list[str]) -> list[str]:
    """Every prefix ``P`` with ``P.param_groups.*`` keys (the first ``param_groups`` segment)."""
    found: dict[str, None] = {}
    for key in keys:
        segs = key.split(".")
        if _GROUPS in segs[:-1]:
            found.setdefault(".".join(segs[: segs.index(_GROUPS)]), None)
    return sorted(found, key=_natural)


def _natural(name: str) -> list[Any]:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def _read_optimizer(prefix: str, entries: dict[str, Any]) -> _Optimizer | str | None:
    """The optimizer under ``prefix``, why it cannot be imported, or None when ``prefix`` holds
    none (a module named ``param_groups``: flattened param groups without ``state`` entries count
    only when they hold no tensors)."""
    head = _head(prefix)
    groups_head, state_head = f"{head}{_GROUPS}.", f"{head}{_STATE}."
    grouped = {k[len(groups_head) :]: k for k in entries if k.startswith(groups_head)}
    opt = _Optimizer(prefix)
    nested = {int(m[1]): k for rest, k in grouped.items() if (m := _NESTED_PARAMS.fullmatch(rest))}
    if nested:  # get_state_dict / FSDP.optim_state_dict: param_groups.<i>.<hyper>, "params" = fqns
        if sorted(nested) != list(range(len(nested))):
            return f"its param groups are numbered {sorted(nested)[:5]}, not 0..{len(nested) - 1}"
        for i in range(len(nested)):
            params = entries[nested[i]]
            if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
                return "its param groups list parameters by index, not by name (optimizer.state_dict())"
            opt.groups.append({})
        for rest, key in grouped.items():
            index, _, name = rest.partition(".")
            if not index.isdigit() or int(index) >= len(opt.groups) or not name:
                return f"entry {key!r} belongs to no param group"
            opt.groups[int(index)][name] = entries[key]
    else:  # flattened (torchtitan): param_groups.<fqn>.<hyper>, one hyper-parameter set per parameter
        if any("." not in rest for rest in grouped):
            return None
        if not any(k.startswith(state_head) for k in entries):
            if any(isinstance(entries[k], torch.Tensor) for k in grouped.values()):
                return None
        opt.flattened = True
        per_param: dict[str, dict[str, Any]] = {}
        for rest, key in grouped.items():
            fqn, _, name = rest.rpartition(".")
            per_param.setdefault(fqn, {})[name] = entries[key]
        for fqn, hyper in per_param.items():
            same = next((g for g in opt.groups if _same_hyper(g, hyper)), None)
            if same is None:
                opt.groups.append({**hyper, "params": [fqn]})
            else:
                same["params"].append(fqn)
    opt.keys.update(grouped.values())
    known = sorted(set(opt.fqns()), key=len, reverse=True)
    for key in [k for k in entries if k.startswith(state_head)]:
        rest = key[len(state_head) :]
        fqn, _, name = rest.rpartition(".")
        for f in known:  # a parameter named in the param groups, else the last segment is the name
            if rest.startswith(f + "."):
                fqn, name = f, rest[len(f) + 1 :]
                break
        if not fqn or not name or "." in name:
            return f"state entry {key!r} is no <parameter>.<state name> of its param groups"
        value = entries[key]
        if isinstance(value, torch.Tensor):
            opt.tensors[f"optimizer.state.{fqn}.{name}"] = value
        else:
            opt.values.setdefault(fqn, {})[name] = value
        opt.keys.add(key)
    return opt


def _same_hyper(group: dict[str, Any], hyper: dict[str, Any]) -> bool:
    return set(group) - {"params"} == set(hyper) and all(_same(group[k], v) for k, v in hyper.items())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and bool(a == b)


def _model_prefix(fqns: list[str], tensor_keys: set[str]) -> str | None:
    """The prefix ``M`` with ``M.<fqn>`` (``<fqn>`` for ``M == ""``) a tensor for every optimizer
    parameter; None when no prefix covers them all."""
    if not fqns:
        return None
    first = fqns[0]
    candidates = [k[: -len(first) - 1] for k in tensor_keys if k.endswith("." + first)]
    candidates += [""] if first in tensor_keys else []
    candidates.sort(key=lambda c: (c != "model", len(c)))
    for m in candidates:
        if all(_head(m) + f in tensor_keys for f in fqns):
            return m
    return None


def map_import(tensors: dict[str, torch.Tensor], values: dict[str, Any]) -> Imported:
    """Map one DCP checkpoint's entries (every part's, prefixed: ``find_parts``) onto unickpt's
    keys (module docstring). CheckpointError when the optimizer's parameters are not all tensors
    of the model, or two entries map to one unickpt key."""
    entries: dict[str, Any] = {**values, **tensors}
    skipped: list[str] = []
    optimizers: list[_Optimizer] = []
    for prefix in _optimizer_prefixes(list(entries)):
        found = _read_optimizer(prefix, entries)
        if found is None:
            continue
        if isinstance(found, str):
            skipped.append(f"{prefix or '<top level>'} (an optimizer state dict that is not importable: {found})")
            head = _head(prefix)
            taken = {k for k in entries if k.startswith(f"{head}{_GROUPS}.") or k.startswith(f"{head}{_STATE}.")}
            for k in taken:
                entries.pop(k)
            continue
        optimizers.append(found)
    optim = optimizers[0] if optimizers else None
    for other in optimizers[1:]:
        skipped.append(f"{other.prefix} (a second optimizer: unickpt checkpoints hold one)")
    for o in optimizers:
        for k in o.keys:
            entries.pop(k, None)
    tensor_keys = {k for k, v in entries.items() if isinstance(v, torch.Tensor)}
    tops = {k.partition(".")[0] for k in entries}
    training = any(t in tops for t in (*_TRAINING, _LOADER))
    if optim is not None and optim.fqns():
        model = _model_prefix(optim.fqns(), tensor_keys)
        if model is None:
            absent = [f for f in optim.fqns() if not any(k == f or k.endswith("." + f) for k in tensor_keys)]
            raise ConfigurationError(
                f"the DCP checkpoint's optimizer ({optim.prefix!r}) updates parameters that are no tensors of one "
                f"model state dict in it (e.g. {absent[:3] or optim.fqns()[:3]}): cannot tell which entries are "
                "the model"
            )
    elif any(k.startswith("model.") for k in tensor_keys) and (
        not training or all(k.startswith("model.") for k in tensor_keys if k.partition(".")[0] not in _TRAINING)
    ):  # get_state_dict's "model" (beside training state: what the state_dict export writes)
        model = "model"
    else:  # a bare model state dict (torchtitan's model-only checkpoints): FQNs at the top level
        model = ""
    out: dict[str, torch.Tensor] = dict(optim.tensors) if optim else {}
    extra: dict[str, Any] = {}
    loader: dict[str, Any] | None = None
    head = _head(model)
    for key, value in entries.items():
        top, _, rest = key.partition(".")
        is_tensor = isinstance(value, torch.Tensor)
        if top == _LOADER:
            loader = {} if loader is None else loader
            loader[rest] = value
            continue
        if top in _TRAINING or not is_tensor:
            if key.startswith(head) and not is_tensor and model:
                skipped.append(f"{key} (a non-tensor entry of the model state dict)")
                continue
            if rest:
                slot = extra.setdefault(top, {})
                if not isinstance(slot, dict):
                    raise ConfigurationError(f"the DCP checkpoint has both {top!r} and {key!r}")
                slot[rest] = value
            else:
                extra[top] = value
            continue
        name = "model." + key[len(head) :] if key.startswith(head) else key
        if name in out:
            raise ConfigurationError(f"convert: two DCP entries map to {name!r}")
        out[name] = value
    objects: dict[str, Any] = {}
    if optim is not None:
        objects["optimizer"] = {"param_groups": optim.groups, "state_values": optim.values}
    layout = _describe(model, optim, training)
    return Imported(out, objects, extra or None, loader, tuple(skipped), layout)


def _describe(model: str, optim: _Optimizer | None, training: bool) -> str:
    where = f"the model under {model!r}" if model else "the model's FQNs at the top level"
    if optim is None:
        return where + ", no optimizer"
    kind = "flattened (torchtitan)" if optim.flattened else "get_state_dict"
    return f"{where}, the optimizer under {optim.prefix!r} ({kind})" + (", training state" if training else "")


# ----------------------------------------------------------------------------- export


@dataclass(frozen=True, slots=True)
class SavedUnickpt:
    """What an export needs of a unickpt checkpoint: every tensor, the optimizer object, rank 0's
    extra_state, the dataloader state (``read_unickpt``: every rank's, merged where they fit
    together), every other state key's saved state by key (``named``: a ``Stateful``'s
    ``state_dict()`` with its tensors put back, rank 0's value of a per-rank one), and what it
    leaves out (``skipped``)."""

    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    extra_state: Any
    dataloader: Any
    skipped: tuple[str, ...]
    named: dict[str, Any] = field(default_factory=dict)


_BLOB = re.compile(r"(?P<key>[^/]+)/(?:(?P<replicated>replicated)|rank(?P<rank>\d{1,9}))")


def read_unickpt(path: str, role: str | None = None) -> SavedUnickpt:
    """Read the unickpt checkpoint at ``path`` whole (each tensor assembled from its shards).

    Blobs, by the state kind that wrote them (``state.items``): ``<key>/replicated`` (a
    ``Stateful``: its tensors ``<key>.<path>`` are taken out of ``tensors`` and put back where
    its placeholders stand, ``state.items.join_tensors``), ``<key>/rank<r>`` (``extra_state``,
    ``PerRank`` and plain values: rank 0's, the others listed), ``dataloader/rank<r>`` (a loader
    with ``state_dict``: ``_merged_loader``); the blobs of a ``unickpt.data`` loader are listed."""
    from ..engine.read import read_blob
    from ..format.values import decode_value, loads_value
    from ..frameworks.optim_state import read_saved
    from ..state.tree import escapes_dicts, join_tensors
    from .inspect import load_metadata
    from .merge import read_full_tensor

    storage, md, _ = load_metadata(path, role)
    read_saved(md)  # the optimizer object's structure checked, as a load would
    tensors = {key: read_full_tensor(md, storage, key) for key in md.tensors}
    raw = md.objects.get("optimizer")
    optimizer = decode_value(raw, "checkpoint object 'optimizer'") if raw is not None else None

    def value(blob: str) -> Any:
        return loads_value(read_blob(md, storage, md.blobs[blob], 0), f"{path}: {blob}")

    named: dict[str, Any] = {}
    loaders: dict[int, Any] = {}
    skipped: list[str] = []
    for blob in md.blobs:
        m = _BLOB.fullmatch(blob)
        if m is None:  # the unickpt.data protocol's replicated-of-N / part-P-of-N
            skipped.append(f"{blob} (unickpt.data loader state: no DCP layout holds it; resume from unickpt)")
        elif m["key"] == _LOADER and m["rank"] is not None:
            loaders[int(m["rank"])] = value(blob)
        elif m["replicated"]:
            key = m["key"]
            own = {k: tensors.pop(k) for k in list(tensors) if k == key or k.startswith(key + ".")}
            named[key] = join_tensors(value(blob), own, key, escapes_dicts(md.objects))
        elif m["rank"] == "0":
            named[m["key"]] = value(blob)
        else:
            skipped.append(f"{blob} (state of another rank: the export keeps rank 0's)")
    extra_state = named.pop("extra_state", None)
    dataloader, left = _merged_loader(loaders)
    skipped += left
    return SavedUnickpt(tensors, optimizer, extra_state, dataloader, tuple(skipped), named)


def _merged_loader(per_rank: dict[int, Any]) -> tuple[Any, list[str]]:
    """One ``dataloader`` entry from every rank's loader state: their dicts merged when no name has
    two different values (torchtitan's ``{"dp_rank_<r>": ..., "world_size": n}``: what its DCP
    manager writes from every rank), else rank 0's (the others listed)."""
    if not per_rank:
        return None, []
    ranks = sorted(per_rank)
    if len(ranks) > 1 and all(isinstance(per_rank[r], dict) for r in ranks):
        merged: dict[str, Any] = {}
        if all(_same(merged.setdefault(k, v), v) for r in ranks for k, v in per_rank[r].items()):
            return merged, []
    first = per_rank[ranks[0]] if ranks[0] == 0 else None
    return first, [f"{_LOADER}/rank{r} (state of another rank: the export keeps rank 0's)" for r in ranks if r != 0]


def export_state(saved: SavedUnickpt, layout: str) -> tuple[dict[str, Any], list[str]]:
    """The state dict ``dcp.save`` writes for ``layout`` (module docstring), and what it leaves out."""
    if layout not in EXPORT_LAYOUTS:
        raise ConfigurationError(f"unknown DCP layout {layout!r}: one of {', '.join(EXPORT_LAYOUTS)}")
    model = {k[len("model.") :]: t for k, t in saved.tensors.items() if k.startswith("model.")}
    state_of: dict[str, dict[str, Any]] = {}
    for key, t in saved.tensors.items():
        if key.startswith("optimizer.state."):
            fqn, _, name = key[len("optimizer.state.") :].rpartition(".")
            state_of.setdefault(fqn, {})[name] = t
    groups: list[dict[str, Any]] = []
    if saved.optimizer is not None:
        for fqn, vals in saved.optimizer.get("state_values", {}).items():
            st = state_of.setdefault(fqn, {})
            for k, v in vals.items():
                st.setdefault(k, v)
        groups = [dict(g) for g in saved.optimizer["param_groups"]]
    others = [k for k in saved.tensors if not k.startswith(("model.", "optimizer.state."))]
    skipped = list(saved.skipped)
    if layout == "state_dict":
        out: dict[str, Any] = {"model": model}
        if state_of or groups:
            out["optimizer"] = {"state": state_of, "param_groups": groups}
        for key in others:
            if key.partition(".")[0] in out:
                raise ConfigurationError(f"tensor {key!r} would land inside DCP's {key.partition('.')[0]!r} entry")
            out[key] = saved.tensors[key]
        _place(out, saved.named, "state_dict layout")  # lr_scheduler ...: under its key, as dcp.save(state) writes it
        for name, value in (("extra_state", saved.extra_state), (_LOADER, saved.dataloader)):
            if value is not None:
                skipped.append(f"{name} (not part of get_state_dict's layout: use --layout torchtitan to write it)")
        return out, skipped
    out = dict(model)
    flat: dict[str, Any] = {}
    for fqn, st in state_of.items():
        for name, v in st.items():
            flat[f"{_STATE}.{fqn}.{name}"] = v
    for g in groups:
        for fqn in g["params"]:
            for k, v in g.items():
                if k != "params":  # param_names kept: torch's flattening has it, torchtitan's ignores it
                    flat[f"{_GROUPS}.{fqn}.{k}"] = v
    names = {"optimizer": flat} if flat else {}
    if isinstance(saved.extra_state, dict):
        names.update(saved.extra_state)
    elif saved.extra_state is not None:
        skipped.append("extra_state (not a dict of named entries: torchtitan's layout has no place for it)")
    for name, value in saved.named.items():  # lr_scheduler, train_state ...: Statefuls under their own key
        if name in names:
            raise ConfigurationError(
                f"torchtitan layout: the checkpoint has both a state key {name!r} and an extra_state entry of that "
                "name; export with --layout state_dict"
            )
        names[name] = value
    if saved.dataloader is not None:
        names[_LOADER] = saved.dataloader
    _place(out, names, "torchtitan layout")
    skipped += [
        f"{k} (a tensor outside the model and optimizer: torchtitan's layout has no place for it)" for k in others
    ]
    return out, skipped


def _place(out: dict[str, Any], names: dict[str, Any], layout: str) -> None:
    """``out[name] = value`` for each entry; CheckpointError when one would collide with a key
    ``out`` holds (DCP flattens ``name`` and ``name.<x>`` into one namespace)."""
    for name, value in names.items():
        clash = [k for k in out if k == name or k.startswith(name + ".") or name.startswith(k + ".")]
        if clash:
            raise ConfigurationError(f"{layout}: the entry {name!r} would collide with {clash[0]!r}")
        out[name] = value
