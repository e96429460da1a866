"""``unickpt convert``: checkpoints from elsewhere into unickpt's format, and unickpt into DCP.

Imports (written with ``framework="tensors"``, ``FlatTensors``; loadable by ``unickpt.load``
into any framework at any world size):
- ``from_hf(folder, out)``: a Hugging Face safetensors folder (``model.safetensors`` or shards
  with ``model.safetensors.index.json``) -> ``model.<name>`` tensors, so a pre-trained model can
  start an FSDP / DTensor run with ``unickpt.load``.
- ``from_dcp(folder, out)``: a PyTorch DCP checkpoint (``.metadata`` + ``*.distcp``), also the
  layout of ByteCheckpoint (a folder with ``model/``, ``optimizer/``, ``extra_state/``, each a
  DCP checkpoint: ``model`` and ``optimizer`` are imported). DCP's metadata is a pickle: it is
  read with ``SafeDCPUnpickler``, which builds only DCP's metadata classes, ``torch.Size``,
  dtypes and layouts, and refuses everything else before anything runs. Tensor keys are kept;
  torch's ``get_state_dict`` optimizer keys ``optim.state.<fqn>.<name>`` become unickpt's
  ``optimizer.state.<fqn>.<name>``, and its param groups (``optim.param_groups``, stored by DCP
  as a ``torch.save`` of plain values) unickpt's: read with ``torch.load(weights_only=True)``,
  which rebuilds plain values only (DCP's own loader would unpickle anything), so the imported
  checkpoint loads into a live optimizer with its hyper-parameters. Other non-tensor entries are
  listed as skipped.
Export:
- ``to_dcp(path, out)``: every tensor of a unickpt checkpoint, whole, written by DCP itself
  (``torch.distributed.checkpoint.save`` in one process), under unickpt's keys.
Sources are not trusted: ``tools.dcp_read`` and ``tools.hf_read`` read only regular files inside
the source folder, bound every read by the file's size and every header by a stated cap, and
refuse a DCP tensor its chunks do not tile exactly, before anything is allocated.
Imports and exports hold the checkpoint's tensors in memory once (the formats are written in one
call); ``merge`` is the streaming path to safetensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.values import encode_value
from ..frameworks.flat import FlatTensors
from .dcp_read import SafeDCPUnpickler, read_dcp_metadata, read_dcp_state
from .hf_read import hf_shard_names, load_shard
from .source_files import is_subfolder

__all__ = ["ConvertResult", "SafeDCPUnpickler", "read_dcp_metadata", "from_hf", "from_dcp", "to_dcp"]


@dataclass(frozen=True, slots=True)
class ConvertResult:
    out: str
    tensors: int
    skipped: tuple[str, ...] = field(default_factory=tuple)


def _save_flat(tensors: dict[str, torch.Tensor], out: str, objects: dict[str, Any] | None = None) -> None:
    import unickpt

    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"convert: {out} is not empty; convert writes a new checkpoint only")
    unickpt.save(out, {"model": FlatTensors(tensors, objects)}, framework="tensors")


def from_hf(folder: str, out: str) -> ConvertResult:
    """Import a Hugging Face safetensors folder (module docstring)."""
    names, where = hf_shard_names(folder)
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        for k, v in load_shard(folder, name, where).items():
            tensors[f"model.{k}"] = v
    _save_flat(tensors, out)
    return ConvertResult(out, len(tensors))


def _dcp_tensors(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a DCP checkpoint, and its non-tensor entries as plain values
    (``tools.dcp_read``: paths, sizes and tiling checked before anything is allocated)."""
    return read_dcp_state(folder)


def _param_groups(values: dict[str, Any], part: str | None) -> tuple[list[dict[str, Any]] | None, set[str]]:
    """The optimizer's param groups among a DCP checkpoint's plain values, and the keys they
    came from. DCP flattens ``get_state_dict``'s ``optim["param_groups"]`` (a list of dicts) into
    ``optim.param_groups.<i>.<name>`` entries (ByteCheckpoint's ``optimizer/``:
    ``param_groups.<i>.<name>``); each group is a dict of hyper-parameters with ``params``, the
    parameters' fqns."""
    head = "param_groups." if part == "optimizer" else "optim.param_groups."
    groups: dict[int, dict[str, Any]] = {}
    used = set()
    for key, value in values.items():
        if not key.startswith(head):
            continue
        index, _, name = key[len(head) :].partition(".")
        if not index.isdigit() or not name:
            continue
        groups.setdefault(int(index), {})[name] = value
        used.add(key)
    ordered = [groups[i] for i in sorted(groups)]
    ok = (
        bool(ordered)
        and list(sorted(groups)) == list(range(len(ordered)))
        and all(isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"]) for g in ordered)
    )
    return (ordered, used) if ok else (None, set())


def _unickpt_key(key: str, part: str | None) -> str:
    if key.startswith("optim.state."):
        return "optimizer.state." + key[len("optim.state.") :]
    if part == "model":  # ByteCheckpoint's model/ holds the model's own fqns
        return f"model.{key}"
    if part == "optimizer" and key.startswith("state."):
        return f"optimizer.{key}"
    return key


def from_dcp(folder: str, out: str) -> ConvertResult:
    """Import a DCP (or ByteCheckpoint) checkpoint (module docstring)."""
    parts: list[tuple[str, str | None]]
    if os.path.isfile(os.path.join(folder, ".metadata")):
        parts = [(folder, None)]
    else:
        parts = [(os.path.join(folder, p), p) for p in ("model", "optimizer") if is_subfolder(folder, p)]
        if not parts:
            raise CheckpointError(
                f"{folder} is neither a DCP checkpoint (.metadata) nor a ByteCheckpoint folder (model/, optimizer/)"
            )
    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    groups: list[dict[str, Any]] | None = None
    for sub, part in parts:
        state, values = _dcp_tensors(sub)
        found, used = _param_groups(values, part)
        if found is not None:
            groups = found
        skipped += [f"{part}/{k}" if part else k for k in values if k not in used]
        for k, v in state.items():
            name = _unickpt_key(k, part)
            if name in tensors:
                raise CheckpointError(f"convert: two DCP entries map to {name!r}")
            tensors[name] = v
    if not tensors:
        raise CheckpointError(f"{folder}: no tensors to import")
    objects = {}
    if groups is not None:  # as the optimizer adapters save them (frameworks.module_state)
        objects["optimizer"] = encode_value({"param_groups": groups, "state_values": {}}, "optimizer")
    _save_flat(tensors, out, objects)
    return ConvertResult(out, len(tensors), tuple(skipped))


def to_dcp(path: str, out: str, *, role: str | None = None) -> ConvertResult:
    """Export every tensor of the unickpt checkpoint at ``path`` as a DCP checkpoint in ``out``."""
    import torch.distributed.checkpoint as dcp

    from .merge import iter_full_tensors

    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"convert: {out} is not empty")
    state = dict(iter_full_tensors(path, role=role))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    return ConvertResult(out, len(state))
