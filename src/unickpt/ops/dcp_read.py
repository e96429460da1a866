"""Reading a PyTorch DCP checkpoint (``.metadata`` + ``*.distcp``) for ``unickpt convert --from dcp``
without trusting it.

``ops.convert.from_dcp`` calls :func:`read_dcp_state` once per DCP folder; it runs, in order:

1. :func:`read_dcp_metadata`: ``.metadata`` is opened as a regular file inside the folder
   (``ops.source_files``: no link, no FIFO), refused over ``DCP_METADATA_LIMIT`` bytes, and
   unpickled by :class:`SafeDCPUnpickler`: only DCP's metadata classes, ``torch.Size``, dtypes,
   layouts and paths are built, and only the instances of DCP's metadata dataclasses may receive
   state (pickle's BUILD), with their own field names: a pickle cannot set an attribute on a class
   or on a shared object (``PosixPath.poisoned = 1``). Every field is then checked for its type
   (:func:`check_metadata`).
2. :func:`plan_reads`: every tensor must be tiled exactly by its chunks (the tiling check of
   unickpt's own metadata, ``format.validation.box_coverage_problem``), every non-empty chunk and
   every non-tensor entry must have a storage entry whose file name is a plain relative path, whose
   bytes lie inside that regular file (``fstat`` size), do not overlap another entry's, and are at
   least the chunk's own bytes. So the tensors allocated next hold no more bytes than the folder's
   files, and every element of them is written by exactly one chunk.
3. The tensors are allocated and every entry is read (each file opened again, the same checks),
   tensors and non-tensor entries with ``torch.load(weights_only=True)`` (plain values only: DCP's
   own loader would unpickle anything); a chunk must come back with its dtype and shape. Every
   tensor loaded (a chunk, or one inside a non-tensor entry) must hold each element of its
   storage at most once (``torch_save_read.check_stored_tensor``): an expanded or overlapping
   view (``torch.zeros(1).expand(2**27)``: 1.6 KB on disk) is refused (``SizeLimitError``)
   before it is copied; a non-tensor entry may hold at most ``torch_save_read.AMPLIFICATION``
   times its bytes, shared values counted at each use (``check_value_bytes``). So what convert
   writes is bounded by the bytes of the entries it read.

Every refusal is a ``CheckpointError`` naming the file, the entry and the problem.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, ClassVar

import torch

from ..errors import (
    CheckpointError,
    ConfigurationError,
    CorruptMetadataError,
    NotACheckpointError,
    TruncatedDataFileError,
)
from ..format.validation import box_coverage_problem
from .source_files import open_regular, read_range, read_small_file
from .torch_save_read import check_stored_tensor, check_value_bytes

__all__ = [
    "DCP_METADATA_LIMIT",
    "SafeDCPUnpickler",
    "read_dcp_metadata",
    "check_metadata",
    "plan_reads",
    "read_dcp_state",
]

DCP_METADATA_LIMIT = 1 << 30  # bytes of ``.metadata`` read and unpickled at most (1 GiB)
_MAX_DIM = 1 << 62  # tensor extents and chunk coordinates stay below (format.tiling's precondition)

_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
_ALLOWED = {
    (_DCP_MD, "Metadata"),
    (_DCP_MD, "TensorStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"),
    (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "StorageMeta"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    (_DCP_FS, "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


@cache
def _settable() -> dict[type, frozenset[str]]:
    """DCP's metadata dataclasses -> the field names a pickle may set on their instances."""
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as m

    classes = (
        m.Metadata,
        m.TensorStorageMetadata,
        m.BytesStorageMetadata,
        m.ChunkStorageMetadata,
        m.TensorProperties,
        m.MetadataIndex,
        m.StorageMeta,
        fs._StorageInfo,
    )
    return {c: frozenset(f.name for f in fields(c)) for c in classes}


class SafeDCPUnpickler(pickle._Unpickler):
    """Builds DCP metadata objects only (module docstring). Any other global, and state given to
    anything but a DCP metadata dataclass instance or under a name that is not one of its fields,
    is refused (``CorruptMetadataError``) before it takes effect. The pure-Python unpickler is used
    because the C one cannot restrict BUILD; it is about half as fast (docs/performance.md,
    "Internals")."""

    stack: list[Any]  # pickle's working stack (set by ``load``)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CorruptMetadataError(
            f"DCP metadata asks to build {module}.{name}, which is not one of DCP's metadata classes: "
            "refusing to unpickle it (the file is not a DCP checkpoint, or was tampered with)"
        )

    def load_build(self) -> None:
        """pickle's BUILD (``obj.__setstate__(state)`` or ``obj.__dict__.update(state)``), for the
        instances of DCP's metadata dataclasses and their own fields only."""
        state = self.stack.pop()
        inst = self.stack[-1]
        names = _settable().get(type(inst))
        if names is None:
            what = f"the class {inst.__qualname__}" if isinstance(inst, type) else f"a {type(inst).__qualname__}"
            raise CorruptMetadataError(
                f"DCP metadata sets attributes on {what}: only DCP's metadata records receive state; refused"
            )
        if type(inst).__name__ == "TensorProperties":  # DCP's own __setstate__ takes a 5-tuple
            if type(state) is not tuple or len(state) != len(names):
                raise CorruptMetadataError(f"DCP metadata gives TensorProperties the state {_short(state)}")
            inst.__setstate__(state)
            return
        if type(state) is not dict:
            raise CorruptMetadataError(f"DCP metadata gives a {type(inst).__qualname__} the state {_short(state)}")
        unknown = [k for k in state if type(k) is not str or k not in names]
        if unknown:
            raise CorruptMetadataError(
                f"DCP metadata sets {_short(unknown)} on a {type(inst).__qualname__}, which has only the "
                f"fields {sorted(names)}; refused"
            )
        inst.__dict__.update(state)

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


def _short(value: object) -> str:
    text = repr(value) if isinstance(value, (dict, tuple, list, str, int)) else type(value).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def read_dcp_metadata(folder: str) -> Any:
    """DCP's ``Metadata`` of ``folder``: bounded read, ``SafeDCPUnpickler``, :func:`check_metadata`."""
    path = os.path.join(folder, ".metadata")
    if not os.path.lexists(path):
        raise NotACheckpointError(f"{folder} is no PyTorch DCP checkpoint (no .metadata file)")
    raw = read_small_file(folder, ".metadata", DCP_METADATA_LIMIT, f"the DCP checkpoint {folder}")
    try:
        md = SafeDCPUnpickler(io.BytesIO(raw)).load()
    except CheckpointError as e:
        raise type(e)(f"{path}: {e}") from None
    except Exception as e:  # a malformed pickle raises anything: it is a corrupt file
        raise CorruptMetadataError(f"{path} is not readable DCP metadata: {type(e).__name__}: {e}") from None
    check_metadata(md, path)
    return md


def check_metadata(md: Any, where: str) -> None:
    """``CorruptMetadataError`` unless every field of DCP's ``Metadata`` ``md`` has the type DCP
    writes (exact types: no subclass, no bool for an int); ``where`` names the file."""
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as m

    def bad(what: str) -> CorruptMetadataError:
        return CorruptMetadataError(f"{where}: {what}")

    def field(obj: Any, name: str) -> Any:
        try:
            return getattr(obj, name)
        except AttributeError:
            raise bad(f"a {type(obj).__name__} has no {name!r}") from None

    if type(md) is not m.Metadata:
        raise bad(f"holds a {type(md).__name__}, not DCP Metadata")
    entries = field(md, "state_dict_metadata")
    if type(entries) is not dict:
        raise bad(f"state_dict_metadata is a {type(entries).__name__}, not a dict")
    for key, meta in entries.items():
        if type(key) is not str:
            raise bad(f"an entry is named by a {type(key).__name__}, not a string")
        if type(meta) is m.TensorStorageMetadata:
            _check_tensor_meta(key, meta, field, bad)
        elif type(meta) is not m.BytesStorageMetadata:
            raise bad(f"entry {key!r} is described by a {type(meta).__name__}")
    storage = field(md, "storage_data")
    if type(storage) is not dict:
        raise bad(f"storage_data is a {type(storage).__name__}, not a dict")
    for index, info in storage.items():
        if type(index) is not m.MetadataIndex or type(field(index, "fqn")) is not str:
            raise bad(f"storage_data is keyed by {_short(index)}, not a DCP MetadataIndex")
        offset, position = field(index, "offset"), field(index, "index")
        if not (offset is None or _is_coords(offset)) or not (position is None or type(position) is int):
            raise bad(f"storage_data's key for {index.fqn!r} has the offset {_short(offset)}")
        if type(info) is not fs._StorageInfo:
            raise bad(f"the storage entry of {index.fqn!r} is a {type(info).__name__}")
        for name in ("offset", "length"):
            value = field(info, name)
            if type(value) is not int or value < 0:
                raise bad(f"the storage entry of {index.fqn!r} has the {name} {_short(value)}")
        if type(field(info, "relative_path")) is not str:
            raise bad(f"the storage entry of {index.fqn!r} names its file by a {type(info.relative_path).__name__}")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:  # DCP's _extensions (e.g. zstd): not read by convert
            raise ConfigurationError(
                f"{where}: entry {index.fqn!r} is stored with the transforms {_short(transforms)} (DCP's "
                "_extensions, e.g. compression), which convert does not read: save it without extensions"
            )
    if not _is_plain(field(md, "planner_data")):
        raise bad("planner_data holds something other than plain values")
    meta = field(md, "storage_meta")
    if meta is not None:
        if type(meta) is not m.StorageMeta:
            raise bad(f"storage_meta is a {type(meta).__name__}")
        for name in ("checkpoint_id", "save_id", "load_id"):
            if not isinstance(field(meta, name), (str, os.PathLike, type(None))):
                raise bad(f"storage_meta.{name} is a {type(getattr(meta, name)).__name__}")
        modules = getattr(meta, "modules", [])
        if type(modules) is not list or not all(type(x) is str for x in modules):
            raise bad("storage_meta.modules is not a list of strings")
    if not isinstance(field(md, "version"), (str, type(None))):
        raise bad(f"version is a {type(md.version).__name__}")


def _check_tensor_meta(key: str, meta: Any, field: Any, bad: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    props, size, chunks = field(meta, "properties"), field(meta, "size"), field(meta, "chunks")
    if type(props) is not TensorProperties or not isinstance(field(props, "dtype"), torch.dtype):
        raise bad(f"tensor {key!r} has no valid TensorProperties (dtype)")
    if not isinstance(field(props, "layout"), torch.layout) or props.layout != torch.strided:
        raise bad(f"tensor {key!r} has the layout {_short(props.layout)}; convert reads dense (strided) tensors")
    if not _is_coords(size):
        raise bad(f"tensor {key!r} has the size {_short(size)}")
    if type(chunks) is not list:
        raise bad(f"tensor {key!r} lists its chunks in a {type(chunks).__name__}")
    for chunk in chunks:
        if type(chunk) is not ChunkStorageMetadata:
            raise bad(f"tensor {key!r} has a chunk described by a {type(chunk).__name__}")
        for name in ("offsets", "sizes"):
            coords = field(chunk, name)
            if not _is_coords(coords) or len(coords) != len(size):
                raise bad(f"tensor {key!r} (size {tuple(size)}) has a chunk with the {name} {_short(coords)}")


def _is_coords(value: Any) -> bool:
    """A tuple (torch.Size) of non-negative ints below 2^62."""
    return isinstance(value, tuple) and all(type(v) is int and 0 <= v < _MAX_DIM for v in value)


def _is_plain(value: Any) -> bool:
    """None, str, int, float, bool, and tuples, lists and dicts of those: iterative, each container
    visited once (a pickle can build cycles and shared children: no endless or exponential walk)."""
    todo, visited = [value], set()
    while todo:
        x = todo.pop()
        if x is None or type(x) in (str, int, float, bool) or id(x) in visited:
            continue
        visited.add(id(x))
        if type(x) in (tuple, list):
            todo.extend(x)
        elif type(x) is dict:
            todo.extend(x.keys())
            todo.extend(x.values())
        else:
            return False
    return True


@dataclass(frozen=True, slots=True)
class StoredItem:
    """One read of :func:`read_dcp_state`: the entry ``key``'s chunk ``offsets``/``sizes`` (both
    None for a non-tensor entry), stored at bytes ``[offset, offset + length)`` of ``file``."""

    key: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...] | None
    file: str
    offset: int
    length: int

    @property
    def what(self) -> str:
        if self.offsets is None:
            return f"entry {self.key!r}"
        return f"tensor {self.key!r} chunk at offsets {self.offsets} (sizes {self.sizes})"


def plan_reads(folder: str, md: Any) -> tuple[list[StoredItem], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Every read that imports ``md`` (checked by :func:`check_metadata`), and every tensor's
    ``(size, dtype)``; refuses (module docstring, step 2) before anything is allocated."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    where = os.path.join(folder, ".metadata")
    items: list[StoredItem] = []
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, meta in md.state_dict_metadata.items():
        if type(meta) is not TensorStorageMetadata:
            info = md.storage_data.get(MetadataIndex(key))
            if info is None:
                raise CorruptMetadataError(f"{where}: entry {key!r} has no storage entry (no file holds it)")
            items.append(StoredItem(key, None, None, info.relative_path, info.offset, info.length))
            continue
        size, dtype = tuple(meta.size), meta.properties.dtype
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
        problem = box_coverage_problem(size, boxes)
        if problem is not None:
            raise CorruptMetadataError(f"{where}: tensor {key!r} (size {size}) is not tiled by its chunks: {problem}")
        for offsets, sizes in boxes:
            need = math.prod(sizes) * dtype.itemsize
            if need == 0:
                continue  # an empty chunk holds nothing to read
            info = md.storage_data.get(MetadataIndex(key, offsets))
            if info is None:
                raise CorruptMetadataError(f"{where}: tensor {key!r} has no storage entry for its chunk at {offsets}")
            item = StoredItem(key, offsets, sizes, info.relative_path, info.offset, info.length)
            if info.length < need:
                raise CorruptMetadataError(
                    f"{where}: {item.what} needs {need} bytes, but its storage entry holds {info.length}"
                )
            items.append(item)
        shapes[key] = (size, dtype)
    _check_files(folder, items, where)
    return items, shapes


def _by_file(items: Iterable[StoredItem]) -> dict[str, list[StoredItem]]:
    files: dict[str, list[StoredItem]] = {}
    for item in items:
        files.setdefault(item.file, []).append(item)
    for group in files.values():
        group.sort(key=lambda i: (i.offset, i.length))
    return files


def _check_files(folder: str, items: list[StoredItem], where: str) -> None:
    """Each file is a regular file inside ``folder`` holding its entries' bytes, none overlapping."""
    for name, group in _by_file(items).items():
        path = os.path.join(folder, name)
        with open_regular(folder, name, where) as (_, size):
            pass
        end, last = 0, None
        for item in group:
            if item.offset > size - item.length:
                raise TruncatedDataFileError(
                    f"{where}: {item.what} is stored at bytes [{item.offset}, {item.offset + item.length}) "
                    f"of {path}, which holds {size} bytes"
                )
            if last is not None and item.offset < end:
                raise CorruptMetadataError(
                    f"{where}: {item.what} and {last.what} share bytes of {path} "
                    f"([{item.offset}, {item.offset + item.length}) and [{last.offset}, {end}))"
                )
            if item.offset + item.length >= end:
                end, last = item.offset + item.length, item


def read_dcp_state(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of the DCP checkpoint in ``folder`` (by DCP key, in its metadata's order) and
    its non-tensor entries as plain values (module docstring: steps 1 to 3)."""
    md = read_dcp_metadata(folder)
    items, shapes = plan_reads(folder, md)
    where = os.path.join(folder, ".metadata")
    tensors = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in shapes.items()}
    values: dict[str, Any] = {}
    for name, group in _by_file(items).items():
        path = os.path.join(folder, name)
        with open_regular(folder, name, where) as (fd, size):  # opened again: the same checks
            for item in group:
                raw = read_range(fd, size, item.offset, item.length, path, item.what)
                if item.offsets is None:
                    values[item.key] = _plain_value(raw, item, path)
                else:
                    _copy_chunk(tensors[item.key], raw, item, path)
    return tensors, {key: values[key] for key in md.state_dict_metadata if key in values}


def _plain_value(raw: bytes, item: StoredItem, path: str) -> Any:
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # not plain values: refused, never unpickled
        raise CorruptMetadataError(f"{path}: {item.what} is not plain values ({type(e).__name__}); refused") from None
    for tensor in _tensors_in(value):
        check_stored_tensor(tensor, f"{path}: {item.what}")
    check_value_bytes(value, len(raw), f"{path}: {item.what}")
    return value


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors inside a value ``torch.load(weights_only=True)`` built: iterative, each
    container visited once (a pickle can build cycles and shared children)."""
    found, todo, visited = [], [value], set()
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (tuple, list, set, frozenset, dict)) and id(x) not in visited:
            visited.add(id(x))
            todo.extend((*x.keys(), *x.values()) if isinstance(x, dict) else x)
    return found


def _copy_chunk(dest: torch.Tensor, raw: bytes, item: StoredItem, path: str) -> None:
    """Load one chunk (a ``torch.save`` of a tensor) and copy it into its box of ``dest``."""
    assert item.offsets is not None and item.sizes is not None
    try:
        chunk = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptMetadataError(
            f"{path}: {item.what} is not a tensor saved by torch.save ({type(e).__name__}: {e})"
        ) from None
    if type(chunk) is not torch.Tensor or chunk.layout != torch.strided:
        raise CorruptMetadataError(f"{path}: {item.what} holds a {type(chunk).__name__}, not a dense tensor")
    check_stored_tensor(chunk, f"{path}: {item.what}")
    if chunk.dtype != dest.dtype or tuple(chunk.shape) != item.sizes:
        raise CorruptMetadataError(
            f"{path}: {item.what} holds a {chunk.dtype} tensor of shape {tuple(chunk.shape)}, "
            f"not the {dest.dtype} of shape {item.sizes} the metadata describes"
        )
    box = tuple(slice(o, o + n) for o, n in zip(item.offsets, item.sizes))
    dest[box].copy_(chunk)
