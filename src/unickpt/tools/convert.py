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
Export:
- ``to_dcp(path, out, layout=...)``: a unickpt checkpoint written by DCP itself
  (``torch.distributed.checkpoint.save`` in one process) as ``get_state_dict`` lays out
  ``{"model", "optimizer"}`` (default), or as torchtitan's checkpointer does.
Imports and exports hold the checkpoint's tensors in memory once (the formats are written in one
call); ``merge`` is the streaming path to safetensors.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError, CorruptMetadataError
from ..format.values import encode_value
from ..frameworks.flat import FlatTensors

__all__ = ["ConvertResult", "SafeDCPUnpickler", "read_dcp_metadata", "from_hf", "from_dcp", "to_dcp"]

_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_MD, "Metadata"),
    (_DCP_MD, "TensorStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"),
    (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "StorageMeta"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_MAX_METADATA = 1 << 30


@dataclass(frozen=True, slots=True)
class ConvertResult:
    out: str
    tensors: int
    skipped: tuple[str, ...] = field(default_factory=tuple)
    layout: str = ""  # the DCP layout recognised (import) or written (export)


class SafeDCPUnpickler(pickle.Unpickler):
    """Builds DCP metadata objects only; any other global is refused (``CorruptMetadataError``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CorruptMetadataError(
            f"DCP metadata asks to build {module}.{name}, which is not one of DCP's metadata classes: "
            "refusing to unpickle it (the file is not a DCP checkpoint, or was tampered with)"
        )


def read_dcp_metadata(folder: str) -> Any:
    """DCP's ``Metadata`` of ``folder`` through ``SafeDCPUnpickler`` (bounded read)."""
    path = os.path.join(folder, ".metadata")
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} is no PyTorch DCP checkpoint (no .metadata file)")
    with open(path, "rb") as f:
        raw = f.read(_MAX_METADATA + 1)
    if len(raw) > _MAX_METADATA:
        raise CorruptMetadataError(f"{path} is larger than {_MAX_METADATA} bytes")
    try:
        md = SafeDCPUnpickler(io.BytesIO(raw)).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CorruptMetadataError(f"{path} is not readable DCP metadata: {type(e).__name__}: {e}") from e
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise CorruptMetadataError(f"{path} holds a {type(md).__name__}, not DCP Metadata")
    return md


def _save_flat(
    tensors: dict[str, torch.Tensor],
    out: str,
    objects: dict[str, Any] | None = None,
    extra_state: Any = None,
    dataloader: Any = None,
) -> None:
    import unickpt

    from .dcp_layouts import ImportedLoaderState

    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"convert: {out} is not empty; convert writes a new checkpoint only")
    state: dict[str, Any] = {"model": FlatTensors(tensors, objects)}
    if extra_state is not None:
        state["extra_state"] = extra_state
    if dataloader is not None:
        state["dataloader"] = ImportedLoaderState(dataloader)
    unickpt.save(out, state, framework="tensors")


def from_hf(folder: str, out: str) -> ConvertResult:
    """Import a Hugging Face safetensors folder (module docstring)."""
    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if "/" in name or name.startswith("."):
            raise CheckpointError(f"{index} names a file outside the folder: {name!r}")
        for k, v in load_file(os.path.join(folder, name)).items():
            tensors[f"model.{k}"] = v
    _save_flat(tensors, out)
    return ConvertResult(out, len(tensors))


class _SafeReader:  # built lazily: FileSystemReader is imported only when DCP is used
    @staticmethod
    def make(folder: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        class Reader(FileSystemReader):
            def read_metadata(self) -> Any:
                md = read_dcp_metadata(folder)
                md.storage_meta = getattr(md, "storage_meta", None)
                return md

        return Reader(folder)


def _dcp_tensors(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a DCP checkpoint, and its non-tensor entries as plain values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class PlainValues(DefaultLoadPlanner):
        """DCP's planner, but non-tensor entries are rebuilt as plain values only."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
            except Exception as e:  # not plain values: refused, never unpickled
                raise CorruptMetadataError(
                    f"{folder}: entry {read_item.dest_index.fqn!r} is not plain values ({type(e).__name__}); refused"
                ) from None

    md = read_dcp_metadata(folder)
    state: dict[str, Any] = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        else:
            state[key] = None  # filled by PlainValues.load_bytes
    if state:
        planner = PlainValues(flatten_state_dict=False, flatten_sharded_tensors=False)
        try:
            dcp.load(state, storage_reader=_SafeReader.make(folder), planner=planner, no_dist=True)
        except BaseException as e:  # DCP wraps what its reader raised (a BaseException): ours surfaces as itself
            ours = _checkpoint_error(e)
            if ours is None:
                raise
            raise ours from None
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in state.items() if k not in tensors}


def _checkpoint_error(e: BaseException) -> CheckpointError | None:
    """The ``CheckpointError`` inside an exception DCP raised (DCP collects the failures of its
    reads into its own ``CheckpointException``: rank -> (exception, traceback)), if any."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, CheckpointError):
            return x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                todo += [x for x in (f if isinstance(f, tuple) else (f,)) if isinstance(x, BaseException)]
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
    return None


def from_dcp(folder: str, out: str) -> ConvertResult:
    """Import a DCP checkpoint in any layout of ``dcp_layouts`` (get_state_dict under any names,
    torchtitan, Lightning, Accelerate, ByteCheckpoint): weights, optimizer state and param groups,
    training state into ``extra_state`` / dataloader state."""
    from . import dcp_layouts

    parts, skipped = dcp_layouts.find_parts(folder)
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for part in parts:
        state, plain = _dcp_tensors(part.folder)
        for k, v in (*state.items(), *plain.items()):
            key = part.prefix + k
            if key in tensors or key in values:
                raise CheckpointError(f"convert: two DCP entries are named {key!r}")
            (tensors if isinstance(v, torch.Tensor) else values)[key] = v
    imported = dcp_layouts.map_import(tensors, values)
    if not imported.tensors:
        raise CheckpointError(f"{folder}: no tensors to import")
    objects = {k: encode_value(v, k) for k, v in imported.objects.items()}  # as the optimizer adapters save them
    _save_flat(imported.tensors, out, objects, imported.extra_state, imported.dataloader)
    return ConvertResult(out, len(imported.tensors), (*skipped, *imported.skipped), imported.layout)


def to_dcp(path: str, out: str, *, role: str | None = None, layout: str = "state_dict") -> ConvertResult:
    """Export the unickpt checkpoint at ``path`` as a DCP checkpoint in ``out`` in ``layout``
    (``dcp_layouts.EXPORT_LAYOUTS``: get_state_dict's ``{"model", "optimizer"}``, or torchtitan's)."""
    import torch.distributed.checkpoint as dcp

    from . import dcp_layouts

    if layout not in dcp_layouts.EXPORT_LAYOUTS:
        raise CheckpointError(f"unknown DCP layout {layout!r}: one of {', '.join(dcp_layouts.EXPORT_LAYOUTS)}")
    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"convert: {out} is not empty")
    saved = dcp_layouts.read_unickpt(path, role)
    state, skipped = dcp_layouts.export_state(saved, layout)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    return ConvertResult(out, len(saved.tensors), tuple(skipped), layout)
