"""``unickpt convert``: checkpoints from elsewhere into unickpt's format, and unickpt into DCP.

Imports (written with ``framework="tensors"``, ``FlatTensors``; loadable by ``unickpt.load``
into any framework at any world size):
- ``from_hf(folder, out)``: a Hugging Face safetensors folder (``model.safetensors`` or shards
  with ``model.safetensors.index.json``) -> ``model.<name>`` tensors, so a pre-trained model can
  start an FSDP / DTensor run with ``unickpt.load``.
- ``from_dcp(folder, out)``: a PyTorch DCP checkpoint (``.metadata`` + ``*.distcp``) or a folder
  of them, in the layouts of ``dcp_layouts`` (``get_state_dict`` under any top-level names,
  torchtitan, Lightning, Accelerate, ByteCheckpoint): model weights, optimizer state and param
  groups (so a strict ``unickpt.load`` restores lr, betas, weight decay ...), training state as
  ``extra_state`` / dataloader state. DCP's metadata is a pickle: it is read with
  ``SafeDCPUnpickler``, which builds only DCP's metadata classes, ``torch.Size``, dtypes and
  layouts, and refuses everything else before anything runs. Non-tensor entries (stored by DCP
  as a ``torch.save`` of plain values) are read with ``torch.load(weights_only=True)``, which
  rebuilds plain values only (DCP's own loader would unpickle anything).
- ``from_verl_fsdp(folder, out)``: a checkpoint of verl's own ``FSDPCheckpointManager``
  (``model/optim/extra_state_world_size_W_rank_R.pt``), read without running its pickles
  (``ops.verl_read``, ``ops.torch_save_read``): model, optimizer (FSDP2), LR scheduler, RNG.
- ``from_torch(file, out)`` / ``from_lightning(file, out)``: one ``torch.save`` file of a plain
  training script (``{"model": ..., "optimizer": ..., "lr_scheduler": ..., "epoch": ...}``) or a
  Lightning ``.ckpt`` (one process, DDP, or a full state dict of FSDP), read without running its
  pickle (``ops.torch_import``): model, optimizer (param groups, state by parameter name),
  every other ``state_dict()`` under its own key and plain values in ``extra_state``; Lightning's
  trainer state (loops, callbacks, schedulers, epoch, global step ...) as unickpt's Lightning
  strategies save it, so ``trainer.fit(ckpt_path=out)`` resumes from the result.
Export:
- ``to_dcp(path, out, layout=...)``: a unickpt checkpoint written by DCP itself
  (``torch.distributed.checkpoint.save`` in one process) as ``get_state_dict`` lays out
  ``{"model", "optimizer"}`` (default), or as torchtitan's checkpointer does. DCP writes into
  ``OUT/.unickpt-partial/``; its files are renamed into OUT when complete, ``.metadata`` last
  (``output_files.OutputFiles``: a failure or Ctrl-C leaves OUT empty).
Sources are not trusted: ``ops.dcp_read`` and ``ops.hf_read`` read only regular files inside
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

from ..errors import ConfigurationError
from ..folder.target import prepare_output_folder, refuse_nested_output
from ..format.values import encode_value
from ..frameworks.flat import FlatTensors
from .dcp_read import SafeDCPUnpickler, read_dcp_metadata, read_dcp_state
from .hf_read import hf_shard_names, load_shards
from .output_files import OutputFiles
from .torch_import import StateDictOf, param_names_of, read_torch_checkpoint
from .verl_read import import_verl_fsdp

__all__ = [
    "ConvertResult",
    "SafeDCPUnpickler",
    "read_dcp_metadata",
    "from_hf",
    "from_dcp",
    "from_verl_fsdp",
    "from_torch",
    "from_lightning",
    "param_names_of",
    "to_dcp",
]


@dataclass(frozen=True, slots=True)
class ConvertResult:
    out: str
    tensors: int
    skipped: tuple[str, ...] = field(default_factory=tuple)
    layout: str = ""  # the DCP layout recognised (import) or written (export)


def _save_flat(
    tensors: dict[str, torch.Tensor],
    out: str,
    objects: dict[str, Any] | None = None,
    extra_state: Any = None,
    dataloader: Any = None,
    statefuls: dict[str, Any] | None = None,
) -> None:
    """One ``unickpt.save`` of an import: ``tensors`` as ``FlatTensors`` with ``objects``, and
    ``statefuls`` (key -> a ``state_dict()``) saved under their keys as a ``Stateful`` is."""
    import unickpt

    from .dcp_layouts import ImportedLoaderState

    if os.path.exists(out) and os.listdir(out):
        raise ConfigurationError(f"convert: {out} is not empty; convert writes a new checkpoint only")
    state: dict[str, Any] = {"model": FlatTensors(tensors, objects)}
    if extra_state is not None:
        state["extra_state"] = extra_state
    if dataloader is not None:
        state["dataloader"] = ImportedLoaderState(dataloader)
    for key, value in (statefuls or {}).items():
        state[key] = StateDictOf(value)
    unickpt.save(out, state, framework="tensors")


def from_hf(folder: str, out: str) -> ConvertResult:
    """Import a Hugging Face safetensors folder (module docstring)."""
    refuse_nested_output(folder, out, "convert")
    names, where = hf_shard_names(folder)
    tensors = {f"model.{k}": v for k, v in load_shards(folder, names, where).items()}
    _save_flat(tensors, out)
    return ConvertResult(out, len(tensors))


def _dcp_tensors(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a DCP checkpoint, and its non-tensor entries as plain values
    (``ops.dcp_read``: paths, sizes and tiling checked before anything is allocated)."""
    return read_dcp_state(folder)


def from_dcp(folder: str, out: str) -> ConvertResult:
    """Import a DCP checkpoint in any layout of ``dcp_layouts`` (get_state_dict under any names,
    torchtitan, Lightning, Accelerate, ByteCheckpoint): weights, optimizer state and param groups,
    training state into ``extra_state`` / dataloader state."""
    from . import dcp_layouts

    refuse_nested_output(folder, out, "convert")
    parts, skipped = dcp_layouts.find_parts(folder)
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for part in parts:
        state, plain = _dcp_tensors(part.folder)
        for k, v in (*state.items(), *plain.items()):
            key = part.prefix + k
            if key in tensors or key in values:
                raise ConfigurationError(f"convert: two DCP entries are named {key!r}")
            (tensors if isinstance(v, torch.Tensor) else values)[key] = v
    imported = dcp_layouts.map_import(tensors, values)
    if not imported.tensors:
        raise ConfigurationError(f"{folder}: no tensors to import")
    objects = {k: encode_value(v, k) for k, v in imported.objects.items()}  # as the optimizer adapters save them
    _save_flat(imported.tensors, out, objects, imported.extra_state, imported.dataloader)
    return ConvertResult(out, len(imported.tensors), (*skipped, *imported.skipped), imported.layout)


def from_verl_fsdp(folder: str, out: str) -> ConvertResult:
    """Import a checkpoint of verl's ``FSDPCheckpointManager`` (``ops.verl_read``)."""
    refuse_nested_output(folder, out, "convert")
    tensors, skipped, layout = import_verl_fsdp(folder, out)
    return ConvertResult(out, tensors, skipped, layout)


def from_torch(path: str, out: str, *, param_names: list[str] | None = None) -> ConvertResult:
    """Import one ``torch.save`` file (``ops.torch_import``); ``param_names``: the parameters the
    optimizer updates, in its order (``param_names_of(model, optimizer)``), when the file numbers
    them and the numbers cannot be mapped from the file alone."""
    return _from_file(path, out, False, param_names)


def from_lightning(path: str, out: str, *, param_names: list[str] | None = None) -> ConvertResult:
    """Import one Lightning ``.ckpt`` file (``ops.torch_import``): resume with a unickpt strategy
    (``trainer.fit(model, ckpt_path=out)``), or load with ``integrations.lightning.load_from_checkpoint``."""
    return _from_file(path, out, True, param_names)


def _from_file(path: str, out: str, lightning: bool, param_names: list[str] | None) -> ConvertResult:
    refuse_nested_output(path, out, "convert")
    imported = read_torch_checkpoint(path, lightning=lightning, param_names=param_names)
    objects = {k: encode_value(v, k) for k, v in imported.objects.items()}  # as the optimizer adapters save them
    _save_flat(imported.tensors, out, objects, imported.extra_state, imported.dataloader, imported.statefuls)
    return ConvertResult(out, len(imported.tensors), (), imported.layout)


def to_dcp(path: str, out: str, *, role: str | None = None, layout: str = "state_dict") -> ConvertResult:
    """Export the unickpt checkpoint at ``path`` as a DCP checkpoint in ``out`` in ``layout``
    (``dcp_layouts.EXPORT_LAYOUTS``: get_state_dict's ``{"model", "optimizer"}``, or torchtitan's)."""
    import torch.distributed.checkpoint as dcp

    from . import dcp_layouts

    if layout not in dcp_layouts.EXPORT_LAYOUTS:
        raise ConfigurationError(f"unknown DCP layout {layout!r}: one of {', '.join(dcp_layouts.EXPORT_LAYOUTS)}")
    refuse_nested_output(path, out, "convert")
    if os.path.exists(out) and os.listdir(out):
        raise ConfigurationError(f"convert: {out} is not empty")
    saved = dcp_layouts.read_unickpt(path, role)
    state, skipped = dcp_layouts.export_state(saved, layout)
    prepare_output_folder(out, "convert")
    with OutputFiles(out) as files:  # DCP writes into OUT/.unickpt-partial/; its files renamed into OUT at the end
        dcp.save(state, storage_writer=dcp.FileSystemWriter(files.staging()), no_dist=True)
        files.publish_staged(last=".metadata")  # DCP's commit: a reader sees the checkpoint only once it is whole
    return ConvertResult(out, len(saved.tensors), tuple(skipped), layout)
