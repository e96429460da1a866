"""Reading a ``torch.save`` file (zip format) without running its pickle's code, for
``unickpt convert --from verl-fsdp``.

:func:`read_torch_save` (``ops.verl_read`` calls it once per rank file):

1. The file is opened as a regular file inside the source folder (``ops.source_files``: no
   link, no FIFO) and read as a zip: every entry must be stored uncompressed (as ``torch.save``
   writes them: no zip bomb), inside one top folder; ``byteorder`` must say ``little``;
   ``data.pkl`` over ``PICKLE_LIMIT`` bytes is refused (``SizeLimitError``) before it is read.
2. ``data.pkl`` is unpickled by :class:`RestrictedTorchUnpickler`: plain containers, dtypes,
   ``torch.Size``, devices, layouts and tensors (``_rebuild_tensor_v2`` over the zip's storages)
   are built for real; numpy arrays of non-object dtypes too (verl's RNG state), from their own
   bytes only (``_reconstruct`` + BUILD with as many bytes as shape and dtype need; a REDUCE of
   ``numpy.ndarray(shape, dtype)``, which gives memory nobody wrote, is refused). The classes
   of distributed tensors (DTensor and its spec, device mesh, placements; ShardedTensor and its
   shard metadata) are never imported or built: they become inert :class:`Record` objects that
   keep their constructor arguments and pickled state for ``verl_read`` to interpret. Any other
   global is refused before it is built, and pickle's BUILD may only give state to a Record or
   a numpy array.
3. Bounded by the bytes on disk: a storage is read from its zip entry's byte range (the local
   header's offset, stored entries only), only the bytes the pickle says it holds, never the
   whole entry (the entry's CRC is checked when the whole entry is read). Every tensor view must
   lie inside its storage and hold each stored element at most once (:func:`view_problem`):
   an expanded (stride 0) or overlapping view, which would turn a few stored bytes into
   gigabytes once copied, is refused (``SizeLimitError``) before anything is allocated.
   ``verl_read.assemble`` and ``dcp_read`` check the tensors they receive with
   :func:`check_stored_tensor` too. The value as a whole is bounded the same way
   (:func:`check_value_bytes`): its tensors, arrays, strings and bytes, a value the pickle uses
   in several places counted at each (a converter writes every entry on its own), may hold at
   most ``AMPLIFICATION`` times the file's bytes (plus 1 MiB): one stored tensor under 100,000
   keys, or a list that holds itself twice 40 levels deep, is refused (``SizeLimitError``).

Every refusal is a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import CheckpointError, CorruptMetadataError, SizeLimitError, TruncatedDataFileError
from .source_files import open_regular

__all__ = [
    "PICKLE_LIMIT",
    "Record",
    "SubclassTensor",
    "RestrictedTorchUnpickler",
    "read_torch_save",
    "view_problem",
    "check_stored_tensor",
    "AMPLIFICATION",
    "value_bytes",
    "check_value_bytes",
]

PICKLE_LIMIT = 256 << 20  # bytes of data.pkl read and unpickled at most
AMPLIFICATION = 2  # a file's values hold at most this many times its bytes (a tied weight: twice)
_AMPLIFICATION_SLACK = 1 << 20  # ... plus this many bytes (tiny files with shared values)
_MAX_ENTRIES = 1 << 20
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")

_STORAGES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
# classes of distributed tensors: kept as Records, never imported
_RECORDED = {
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._api", "DTensor"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
    ("torch.distributed.tensor.placement_types", "Shard"),
    ("torch.distributed.tensor.placement_types", "Replicate"),
    ("torch.distributed.tensor.placement_types", "_StridedShard"),
    ("torch.distributed.tensor.placement_types", "Partial"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"),
    ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"),
    ("torch.distributed._shard.sharded_tensor.shard", "Shard"),
    ("torch.distributed._shard.metadata", "ShardMetadata"),
    ("torch.distributed._shard.sharded_tensor.metadata", "ShardedTensorMetadata"),
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"),
    ("torch.distributed.remote_device", "_remote_device"),
}


class Record:
    """An inert stand-in for a class of ``_RECORDED``: ``args`` (constructor arguments) and
    ``state`` (what pickle's BUILD gave it, slots merged in)."""

    qualname: ClassVar[str] = "Record"

    def __new__(cls, *args: Any) -> Record:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = {}
        return obj

    args: tuple[Any, ...]
    state: dict[str, Any]

    def __init__(self, *args: Any) -> None:
        self.args = args

    def get(self, name: str, default: Any = None) -> Any:
        return self.state.get(name, default)


@cache
def record_class(qualname: str) -> type[Record]:
    return type(qualname.rpartition(".")[2] or "Record", (Record,), {"qualname": qualname})


@dataclass(frozen=True, slots=True)
class SubclassTensor:
    """A tensor subclass as pickled (``_rebuild_from_type_v2``): its class (``kind``: the
    Record class's qualname), the wrapper's global ``size`` and ``dtype``, and its state."""

    kind: str
    size: tuple[int, ...]
    dtype: torch.dtype
    state: Any


@dataclass(frozen=True, slots=True)
class _Wrapper:
    size: tuple[int, ...]
    dtype: torch.dtype


def _coords(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and 0 <= v < 1 << 62 for v in value):
        raise CorruptMetadataError(f"{what} is {value!r:.200}, not a list of non-negative integers")
    return tuple(value)


def view_problem(size: tuple[int, ...], stride: tuple[int, ...]) -> str | None:
    """None if a view of ``size`` and ``stride`` (non-negative) reaches every stored element at
    most once, else what repeats: a dimension of more than one element with stride 0 (an
    expanded tensor) or a stride not past the reach of the smaller ones (an overlapping view).
    Sufficient for "no element twice" and true of every view torch's slicing, transposing and
    ``contiguous`` make; a view that passes holds at most as many elements as its storage."""
    if math.prod(size) == 0:
        return None
    reach = 0  # the farthest element the dimensions of smaller stride reach
    for step, n in sorted((s, n) for n, s in zip(size, stride) if n > 1):
        if step <= reach:
            kind = "an expanded view (stride 0)" if step == 0 else "an overlapping view"
            return f"{kind}: {math.prod(size)} elements that repeat stored ones"
        reach += (n - 1) * step
    return None


def check_stored_tensor(tensor: torch.Tensor, what: str) -> None:
    """``SizeLimitError`` unless ``tensor`` (read from a foreign file) holds each element of its
    storage at most once and no more bytes than its storage: how ``verl_read.assemble`` and
    ``dcp_read`` refuse a few stored bytes posing as a large tensor, before copying it."""
    size, stride = tuple(tensor.shape), tuple(tensor.stride())
    problem = view_problem(size, tuple(abs(s) for s in stride))
    nbytes = tensor.numel() * tensor.element_size()
    stored = tensor.untyped_storage().nbytes()
    if problem is None and nbytes > stored:
        problem = f"{nbytes} bytes over a storage of {stored}"
    if problem is not None:
        raise SizeLimitError(
            f"{what}: a tensor of size {list(size)} and stride {list(stride)} is {problem}; convert reads only "
            "tensors whose every element is stored in the file (save it with .contiguous() or .clone())"
        )


def _leaf_bytes(x: Any) -> int | None:
    """The bytes of a value that holds no other value, None for a container."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, np.ndarray):
        return x.nbytes
    if isinstance(x, (str, bytes, bytearray)):
        return len(x)
    if isinstance(x, (dict, list, tuple, set, frozenset, Record, SubclassTensor)):
        return None
    return 0  # numbers, None, dtypes, devices, classes


def _children(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return [*x.keys(), *x.values()]
    if isinstance(x, Record):
        return [x.args, x.state]
    if isinstance(x, SubclassTensor):
        return [x.state]
    return list(x)


def value_bytes(value: Any) -> int:
    """The bytes of the tensors, numpy arrays, strings and bytes in ``value`` (as read by
    :func:`read_torch_save` or ``torch.load(weights_only=True)``), a value found in several
    places counted at each, as a converter writing each entry on its own copies it. Each
    container is walked once (sums kept by ``id``): a shared structure 40 levels deep costs 40
    steps, not 2^40; a container inside itself counts once."""
    top = _leaf_bytes(value)
    if top is not None:
        return top
    sums: dict[int, int] = {}
    open_ids: set[int] = set()
    stack: list[tuple[Any, list[Any] | None]] = [(value, None)]
    while stack:
        x, kids = stack.pop()
        if kids is None:
            if id(x) in sums or id(x) in open_ids:
                continue  # walked already, or a container inside itself
            kids = _children(x)
            open_ids.add(id(x))
            stack.append((x, kids))
            stack.extend((k, None) for k in kids if _leaf_bytes(k) is None)
            continue
        open_ids.discard(id(x))
        total = 0
        for k in kids:
            leaf = _leaf_bytes(k)
            total += sums.get(id(k), 0) if leaf is None else leaf
        sums[id(x)] = total
    return sums[id(value)]


def check_value_bytes(value: Any, file_bytes: int, what: str) -> None:
    """``SizeLimitError`` when :func:`value_bytes` of ``value``, read from ``file_bytes`` bytes
    named by ``what``, is over ``AMPLIFICATION`` times them plus 1 MiB."""
    held = value_bytes(value)
    limit = AMPLIFICATION * file_bytes + _AMPLIFICATION_SLACK
    if held > limit:
        raise SizeLimitError(
            f"{what} holds {held} bytes of values (a value used in several places counted at each) in "
            f"{file_bytes} bytes on disk, over {AMPLIFICATION} x those + 1 MiB: refused (stored values used over "
            "and over, which a converter would write out each time)"
        )


class RestrictedTorchUnpickler(pickle._Unpickler):
    """Unpickles ``data.pkl`` of one ``torch.save`` zip (module docstring); ``storage(key, dtype,
    numel)`` returns the zip's storage ``key`` as a flat tensor."""

    stack: list[Any]

    def __init__(self, data: bytes, storage: Any) -> None:
        super().__init__(io.BytesIO(data))
        self._storage = storage

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECORDED:
            return record_class(f"{module}.{name}")
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch":
            if name == "Size":
                return torch.Size
            if name == "device":
                return torch.device
            if name in _STORAGES:
                return _STORAGES[name]
            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module == "torch._utils":
            if name == "_rebuild_tensor_v2":
                return self._rebuild_tensor
            if name == "_rebuild_parameter":
                return _rebuild_parameter
            if name == "_rebuild_wrapper_subclass":
                return _rebuild_wrapper
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _rebuild_from_type
        if module in ("builtins", "__builtin__") and name == "getattr":
            return _record_getattr
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return _np_reconstruct
        if (module, name) == ("numpy", "ndarray"):
            return _NDARRAY
        if (module, name) == ("numpy", "dtype"):
            return _np_dtype
        if (module, name) == ("_codecs", "encode"):
            return _latin1_encode
        raise CorruptMetadataError(
            f"the pickle asks to build {module}.{name}, which a torch.save of tensors, DTensors, "
            "ShardedTensors and plain values does not hold: refusing to unpickle it"
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptMetadataError(f"the pickle names a persistent object {pid!r:.200}, not a storage")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype) or type(key) is not str or type(numel) is not int or numel < 0:
            raise CorruptMetadataError(f"the pickle names a storage {pid!r:.200}")
        return self._storage(key, dtype, numel)

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> torch.Tensor:
        if not isinstance(storage, torch.Tensor):
            raise CorruptMetadataError("a tensor is rebuilt from something that is not a storage")
        size = _coords(size, "a tensor's size")
        stride = _coords(stride, "a tensor's stride")
        if type(offset) is not int or offset < 0 or len(size) != len(stride):
            raise CorruptMetadataError(
                f"a tensor has the offset {offset!r:.50} and {len(size)} sizes, {len(stride)} strides"
            )
        problem = view_problem(size, stride)
        if problem is not None:
            raise SizeLimitError(
                f"a tensor of size {list(size)} and stride {list(stride)} is {problem} (a storage of "
                f"{storage.numel()}); convert reads only tensors whose every element is stored in the file "
                "(save it with .contiguous() or .clone())"
            )
        if math.prod(size) > 0:
            last = offset + sum((n - 1) * s for n, s in zip(size, stride))
            if last >= storage.numel():
                raise CorruptMetadataError(
                    f"a tensor of size {size} (stride {stride}, offset {offset}) reaches element {last} of a "
                    f"storage of {storage.numel()}"
                )
        return torch.as_strided(storage, size, stride, offset)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, np.ndarray) and type(inst) is np.ndarray:
            inst.__setstate__(_np_state(state))
            return
        if isinstance(inst, np.dtype):
            if not (type(state) is tuple and all(v is None or type(v) in (int, str) for v in state)):
                raise CorruptMetadataError("the pickle gives a numpy dtype a state that is not numpy's")
            inst.__setstate__(state)  # type: ignore[attr-defined]
            return
        if type(inst) is OrderedDict and type(state) is dict and set(state) <= {"_metadata"}:
            return  # a module state dict's _metadata (module versions): not needed
        if not isinstance(inst, Record):
            what = f"the class {inst.__qualname__}" if isinstance(inst, type) else f"a {type(inst).__qualname__}"
            raise CorruptMetadataError(f"the pickle sets attributes on {what}: refused")
        if (isinstance(state, tuple) and len(state) != 2) or type(state) is list:  # given to __setstate__
            inst.state["__setstate__"] = state
            return
        if isinstance(state, tuple) and len(state) == 2:  # (dict or None, slot state)
            merged: dict[Any, Any] = {}
            for part in state:
                if part is not None and type(part) not in (dict, OrderedDict):
                    raise CorruptMetadataError(f"the pickle gives a {inst.qualname} the state {type(part).__name__}")
                merged.update(part or {})
            state = merged
        if type(state) not in (dict, OrderedDict) or not all(type(k) is str for k in state):
            raise CorruptMetadataError(f"the pickle gives a {inst.qualname} the state {type(state).__name__}")
        inst.state.update(state)

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


def _layout(name: Any) -> torch.layout:
    if name != "torch.strided":
        raise CorruptMetadataError(f"a tensor has the layout {name!r:.50}; convert reads dense (strided) tensors")
    return torch.strided


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> Any:
    if not isinstance(data, torch.Tensor):
        raise CorruptMetadataError("a parameter is rebuilt from something that is not a tensor")
    return data


def _rebuild_wrapper(cls: Any, dtype: Any, size: Any, stride: Any, offset: Any, layout: Any, *rest: Any) -> _Wrapper:
    if not (isinstance(cls, type) and issubclass(cls, Record)) or not isinstance(dtype, torch.dtype):
        raise CorruptMetadataError("a tensor subclass is rebuilt from something that is not a DTensor/ShardedTensor")
    return _Wrapper(_coords(size, "a tensor subclass's size"), dtype)


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func is _rebuild_wrapper:
        if not isinstance(args, tuple):
            raise CorruptMetadataError("a tensor subclass is rebuilt with arguments that are not a tuple")
        wrapper = _rebuild_wrapper(*args)
        if new_type is not args[0]:
            raise CorruptMetadataError("a tensor subclass names two different classes")
        return SubclassTensor(new_type.qualname, wrapper.size, wrapper.dtype, state)
    raise CorruptMetadataError("a tensor subclass is rebuilt by a function other than _rebuild_wrapper_subclass")


def _record_getattr(obj: Any, name: Any) -> Any:
    """``getattr`` for Records only (ShardedTensor.ProcessGroupState, an enum member)."""
    if not (isinstance(obj, Record) or (isinstance(obj, type) and issubclass(obj, Record))):
        raise CorruptMetadataError("the pickle calls getattr on something that is not a recorded class: refused")
    if type(name) is not str or not _IDENT.fullmatch(name) or name.startswith("__"):
        raise CorruptMetadataError(f"the pickle reads the attribute {name!r:.60}: refused")
    return record_class(f"{obj.qualname}.{name}")


class _NdarrayName:
    """What the pickle's global ``numpy.ndarray`` becomes: the class argument ``_reconstruct``
    expects, which cannot be called (``numpy.ndarray(shape, dtype)`` allocates memory nobody
    wrote: uninitialised heap contents, or a raw MemoryError for a huge shape)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise CorruptMetadataError(
            "the pickle calls numpy.ndarray(shape, dtype), an array whose memory nobody wrote: refused "
            "(numpy pickles its arrays with _reconstruct and their bytes)"
        )


_NDARRAY = _NdarrayName()


def _np_state(state: Any) -> tuple[Any, ...]:
    """numpy's array state ``(version, shape, dtype, is_fortran, bytes)``, checked: non-object
    dtype, and exactly the bytes shape and dtype need (all of them inside data.pkl)."""
    if not (type(state) is tuple and len(state) == 5 and isinstance(state[2], np.dtype)):
        raise CorruptMetadataError("the pickle gives a numpy array a state that is not numpy's")
    version, shape, dtype, fortran, raw = state
    if dtype.hasobject:
        raise CorruptMetadataError("the pickle holds a numpy array of Python objects: refused")
    shape = _coords(shape, "a numpy array's shape")
    if type(version) is not int or type(fortran) not in (bool, int) or type(raw) is not bytes:
        raise CorruptMetadataError("the pickle gives a numpy array a state that is not numpy's")
    need = math.prod(shape) * dtype.itemsize
    if len(raw) != need:
        raise CorruptMetadataError(
            f"a numpy array of shape {shape} and dtype {dtype} needs {need} bytes; the pickle gives it {len(raw)}"
        )
    return (version, shape, dtype, bool(fortran), raw)


def _np_reconstruct(cls: Any, shape: Any, dtype: Any) -> np.ndarray:
    if cls is not _NDARRAY or not isinstance(dtype, bytes):
        raise CorruptMetadataError("the pickle rebuilds a numpy object other than an ndarray")
    return np.ndarray.__new__(np.ndarray, (0,), dtype=np.uint8)


def _np_dtype(name: Any, align: Any = False, copy: Any = True) -> np.dtype:
    if type(name) is not str or not re.fullmatch(r"[biufc]\d{1,2}|\?", name):
        raise CorruptMetadataError(f"the pickle asks for the numpy dtype {name!r:.40}: refused")
    return np.dtype(name, align=bool(align), copy=bool(copy))


def _latin1_encode(text: Any, encoding: Any = "latin1") -> bytes:
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise CorruptMetadataError("the pickle encodes something that is not a latin1 string")
    return text.encode("latin1")


def read_torch_save(folder: str, name: str, where: str) -> Any:
    """The object ``torch.save`` wrote to ``folder/name`` (module docstring)."""
    path = os.path.join(folder, name)
    with open_regular(folder, name, where) as (fd, size):
        with os.fdopen(os.dup(fd), "rb") as f:
            try:
                return _read_zip(f, path, size)
            except CheckpointError as e:
                raise type(e)(f"{path}: {e}") from None
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OSError) as e:
                raise CorruptMetadataError(
                    f"{path} is not a readable torch.save file ({type(e).__name__}: {e})"
                ) from None
            except (pickle.UnpicklingError, IndexError, KeyError, TypeError, AttributeError, RecursionError) as e:
                raise CorruptMetadataError(f"{path}: its pickle is malformed ({type(e).__name__}: {e})") from None


def _read_zip(f: Any, path: str, size: int) -> Any:
    if not zipfile.is_zipfile(f):
        raise CorruptMetadataError("not a zip file: convert reads torch.save's zip format (torch 1.6+) only")
    zf = zipfile.ZipFile(f)
    infos = zf.infolist()
    if len(infos) > _MAX_ENTRIES:
        raise SizeLimitError(f"the zip lists {len(infos)} entries, over {_MAX_ENTRIES}")
    tops = {i.filename.partition("/")[0] for i in infos}
    if len(tops) != 1 or any("/" not in i.filename for i in infos):
        raise CorruptMetadataError(f"the zip's entries are not inside one folder: {sorted(tops)[:5]}")
    top = tops.pop()
    entries = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptMetadataError(
                f"zip entry {info.filename!r} is compressed; torch.save stores entries as they are"
            )
        entries[info.filename[len(top) + 1 :]] = info
    order = entries.get("byteorder")
    if order is not None and (order.file_size > 16 or zf.read(order).strip() != b"little"):
        raise CorruptMetadataError("the tensors are stored big-endian; convert reads little-endian files")
    pkl = entries.get("data.pkl")
    if pkl is None:
        raise CorruptMetadataError("the zip has no data.pkl: not a torch.save file")
    if pkl.file_size > PICKLE_LIMIT:
        raise SizeLimitError(f"data.pkl holds {pkl.file_size} bytes, over the cap of {PICKLE_LIMIT} bytes: refused")
    storages: dict[str, torch.Tensor] = {}

    def storage(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        if key not in storages:
            info = entries.get(f"data/{key}")
            if info is None or not _IDENT.fullmatch("s" + key):
                raise CorruptMetadataError(f"the pickle names the storage {key!r:.60}, which the zip lacks")
            need = numel * dtype.itemsize
            if info.file_size < need:
                raise CorruptMetadataError(
                    f"storage {key!r} holds {info.file_size} bytes, not the {need} of {numel} {dtype}"
                )
            raw = _read_entry(f, info, need, size)
            storages[key] = torch.frombuffer(raw, dtype=dtype) if need else torch.empty(0, dtype=dtype)
        t = storages[key]
        if t.dtype != dtype or t.numel() < numel:
            raise CorruptMetadataError(f"storage {key!r} is named with two dtypes or sizes")
        return t

    value = RestrictedTorchUnpickler(zf.read(pkl), storage).load()
    check_value_bytes(value, size, "the file")
    return value


_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


def _read_entry(f: Any, info: zipfile.ZipInfo, need: int, size: int) -> bytearray:
    """The first ``need`` bytes of the stored zip entry ``info`` of the open file ``f`` of
    ``size`` bytes, read from the entry's own byte range (its local header says where its data
    starts and that it is stored), not the whole entry: a storage of 4 bytes in a 1 GiB entry
    reads 4 bytes. The entry's CRC is checked when all of it is read."""
    if info.header_offset > size - _LOCAL_HEADER:
        raise TruncatedDataFileError(f"zip entry {info.filename!r} starts at byte {info.header_offset}, past the file")
    f.seek(info.header_offset)
    head = f.read(_LOCAL_HEADER)
    if len(head) != _LOCAL_HEADER or head[:4] != b"PK\x03\x04":
        raise CorruptMetadataError(f"zip entry {info.filename!r} has no local header at byte {info.header_offset}")
    if int.from_bytes(head[8:10], "little") != zipfile.ZIP_STORED:
        raise CorruptMetadataError(f"zip entry {info.filename!r} is compressed; torch.save stores entries as they are")
    start = info.header_offset + _LOCAL_HEADER + int.from_bytes(head[26:28], "little")
    start += int.from_bytes(head[28:30], "little")
    if start > size - info.file_size:
        raise TruncatedDataFileError(
            f"zip entry {info.filename!r} is stored at bytes [{start}, {start + info.file_size}) of a file of {size}"
        )
    buf = bytearray(need)
    view, got = memoryview(buf), 0
    f.seek(start)
    while got < need:
        n = f.readinto(view[got:])
        if not n:
            raise TruncatedDataFileError(
                f"the file ended at byte {start + got} while reading zip entry {info.filename!r}"
            )
        got += n
    view.release()
    if need == info.file_size and zlib.crc32(buf) != info.CRC:
        raise CorruptMetadataError(f"zip entry {info.filename!r} fails its CRC check: the file is damaged")
    return buf
