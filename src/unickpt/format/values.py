"""Safe encoding of plain Python values, tensors and numpy values (extra state, RNG states,
dataloader state, optimizer objects): what goes in comes back, with its exact type, or is refused.

A tagged JSON tree. Untagged: ``None``, ``bool``, ``int`` (64-bit), finite ``float``, ``str``,
``list``, ``dict`` with ``str`` keys. Tagged (``{"__unickpt__": tag, ...}``):

=============  =================================================================================
tag            value
=============  =================================================================================
tuple          ``tuple``
intdict        ``dict`` whose keys are all ``int``
odict          ``collections.OrderedDict`` (keys ``str`` or ``int``, order kept)        [new]
set/frozenset  ``set`` / ``frozenset`` (elements sorted by their encoding)              [new]
bigint         ``int`` beyond 64 bits (decimal string)
float          ``inf``, ``-inf``, ``nan``
complex        ``complex`` as [real, imag] (each a float or a tagged float)            [new]
bytes          ``bytes`` (base64)
bytearray      ``bytearray`` (base64)                                                   [new]
size           ``torch.Size``                                                           [new]
torch_dtype    ``torch.dtype`` by its stable name (``format.dtypes``)                   [new]
device         ``torch.device`` (``"cuda:1"``)                                          [new]
tensor         ``torch.Tensor``: dtype name, shape, raw row-major bytes; ``requires_grad`` and
               ``parameter`` (``nn.Parameter``) when set                       [flags new]
ndarray        ``numpy.ndarray``: dtype description (``format.npdtype``: structured, subarray,
               datetime dtypes included), shape, raw C-order bytes      [structured dtypes new]
npscalar       a numpy scalar (``np.float32``, ``np.int64``, ``np.bool_``, ``np.datetime64``,
               structured ``np.void`` ...): dtype description and raw bytes             [new]
np_dtype       a ``numpy.dtype`` value                                                  [new]
=============  =================================================================================

Semantics worth knowing: tensors come back on the CPU, contiguous (strides and storage sharing
are not kept; conjugate / negative views are resolved), as leaves: ``requires_grad`` and
``nn.Parameter`` are kept, autograd history is not. Exact types only: a subclass of a supported
type (a namedtuple, ``defaultdict``, ``IntEnum``, ``np.memmap``, a tensor subclass such as
``DTensor``) is refused rather than silently turned into its base class. Values written before
the new tags existed decode exactly as they did (numpy scalars as Python numbers, bytearrays as
bytes, structured arrays as raw ``|V`` bytes), since the old encoder wrote them that way.

Decoding builds only these types: no pickle, no import of names from the data, no numpy dtype from
an unchecked string, every size checked against the bytes actually present, so loading never runs
code and never allocates more than the blob holds; anything malformed raises
``CorruptMetadataError``. Blobs (extra state, values) go through ``dumps_value`` /
``loads_value``; JSON objects (the optimizer's param groups and non-tensor state) through
``encode_value`` / ``decode_value``.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..errors import CorruptMetadataError, SizeLimitError
from . import npdtype
from .dtypes import dtype_from_name, dtype_name

__all__ = ["encode_value", "decode_value", "dumps_value", "loads_value", "check_size", "MAX_VALUES", "MAX_VALUE_BYTES"]

_TAG = "__unickpt__"
_MAX_DEPTH = 64
_MAX_NDIM = 64
_MAX_DIGITS = 4000  # below Python's int <-> str conversion limit (4300)
_BIGINT = re.compile(rf"-?[0-9]{{1,{_MAX_DIGITS}}}")
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")
_NUMEL_CAP = 1 << 62  # product of a shape's non-zero dims: numpy / torch index arithmetic never overflows


def _refuse(path: str, why: str) -> TypeError:
    return TypeError(f"{path}: {why}")


def encode_value(v: Any, path: str = "extra_state", depth: int = 0) -> Any:
    """The JSON-ready encoding of ``v``; TypeError naming the path inside ``v`` if unsupported."""
    if depth > _MAX_DEPTH:
        raise _refuse(path, f"nesting deeper than {_MAX_DEPTH}")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        if -(1 << 63) <= v < (1 << 64):
            return v
        if v.bit_length() > _MAX_DIGITS * 3:  # ~3.3 bits per digit: refuse well before str() would
            raise _refuse(path, f"an integer of {v.bit_length()} bits is too large to save")
        return {_TAG: "bigint", "v": str(v)}
    if t is float:
        return v if math.isfinite(v) else {_TAG: "float", "v": repr(v)}
    if t is complex:
        return {_TAG: "complex", "v": [encode_value(v.real, path), encode_value(v.imag, path)]}
    if t is bytes:
        return {_TAG: "bytes", "v": base64.b64encode(v).decode()}
    if t is bytearray:
        return {_TAG: "bytearray", "v": base64.b64encode(v).decode()}
    if t is torch.Size:
        return {_TAG: "size", "v": list(v)}
    if t is torch.dtype:
        return {_TAG: "torch_dtype", "v": _torch_dtype_name(v, path)}
    if t is torch.device:
        return {_TAG: "device", "v": str(v)}
    if isinstance(v, torch.Tensor):
        return _encode_tensor(v, path)
    if isinstance(v, np.generic):
        a = np.asarray(v)
        return {_TAG: "npscalar", "dtype": _np_dtype(a.dtype, path), "v": base64.b64encode(a.tobytes()).decode()}
    if t is np.ndarray:
        a = v
        if not v.flags.c_contiguous:  # a C-order copy whose padding bytes (if any) are zeros
            a = np.zeros(v.shape, dtype=v.dtype)
            np.copyto(a, v)
        desc = _np_dtype(a.dtype, path)
        return {_TAG: "ndarray", "dtype": desc, "shape": list(a.shape), "v": base64.b64encode(a.tobytes()).decode()}
    if isinstance(v, np.dtype):
        return {_TAG: "np_dtype", "v": _np_dtype(v, path)}
    if t is tuple:
        return {_TAG: "tuple", "v": [encode_value(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
    if t is list:
        return [encode_value(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    if t is dict:
        return _encode_dict(v, path, depth)
    if t is OrderedDict:
        for k in v:
            if type(k) not in (str, int):
                raise _refuse(path, f"OrderedDict keys must be str or int, got {type(k).__name__}")
        return {_TAG: "odict", "v": [[k, encode_value(x, f"{path}[{k!r}]", depth + 1)] for k, x in v.items()]}
    if t is set or t is frozenset:
        items = [encode_value(x, f"{path}{{}}", depth + 1) for x in v]
        items.sort(key=lambda e: json.dumps(e, sort_keys=True))
        return {_TAG: t.__name__, "v": items}
    raise _refuse(path, _unsupported(v))


def _encode_dict(v: dict[Any, Any], path: str, depth: int) -> Any:
    if v and all(type(k) is int for k in v):
        return {_TAG: "intdict", "v": [[k, encode_value(x, f"{path}[{k}]", depth + 1)] for k, x in v.items()]}
    out = {}
    for k, x in v.items():
        if type(k) is not str:
            raise _refuse(path, f"dict keys must be all str or all int, got {type(k).__name__}")
        if k == _TAG:
            raise _refuse(path, f"the key {_TAG!r} is reserved")
        out[k] = encode_value(x, f"{path}.{k}", depth + 1)
    return out


def _encode_tensor(v: torch.Tensor, path: str) -> dict[str, Any]:
    if type(v) not in (torch.Tensor, torch.nn.Parameter):
        kind = type(v).__name__
        raise _refuse(path, f"tensor subclass {kind} cannot be saved as a value; convert it to a plain tensor")
    if v.layout != torch.strided:
        raise _refuse(path, f"{v.layout} tensors cannot be saved as a value; convert with .to_dense()")
    if v.is_meta:
        raise _refuse(path, "a tensor on the meta device has no data to save")
    if any(n is not None for n in getattr(v, "names", None) or ()):
        raise _refuse(path, "named tensors cannot be saved as a value; call .rename(None) first")
    name = _torch_dtype_name(v.dtype, path)
    t = v.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    # contiguous, yet a size-1 dimension may keep any stride (z.imag of one element): as_strided
    raw = t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    out: dict[str, Any] = {_TAG: "tensor", "dtype": name, "shape": list(t.shape), "v": base64.b64encode(raw).decode()}
    if v.requires_grad:
        out["requires_grad"] = True
    if type(v) is torch.nn.Parameter:
        out["parameter"] = True
    return out


def _torch_dtype_name(dt: torch.dtype, path: str) -> str:
    try:
        return dtype_name(dt)
    except TypeError as e:
        raise _refuse(path, str(e)) from None


def _np_dtype(dt: np.dtype, path: str) -> Any:
    desc = npdtype.describe(dt, path)
    if dt.itemsize == 0:
        raise _refuse(path, f"numpy dtype {dt} has no bytes per element")
    return desc


def _unsupported(v: Any) -> str:
    """Why ``v`` cannot be saved, with what to do instead."""
    kind = type(v).__name__
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return f"namedtuple {kind} cannot be saved (unickpt does not recreate classes); save tuple(v) or v._asdict()"
    for base in (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset, np.ndarray):
        if isinstance(v, base):
            convert = "np.asarray(v)" if base is np.ndarray else f"{base.__name__}(v)"
            return (
                f"{kind} is a subclass of {base.__name__} and would come back as a plain {base.__name__}; "
                f"convert it before saving (e.g. {convert})"
            )
    return (
        f"cannot save a value of type {kind}; extra state holds plain values, tensors and numpy "
        "arrays (call state_dict() on objects first)"
    )


# --------------------------------------------------------------------------- decoding


def decode_value(v: Any, source: str = "extra state", depth: int = 0) -> Any:
    """The value ``encode_value`` encoded as ``v`` (parsed JSON); CorruptMetadataError naming
    ``source`` for anything the encoder would not have written."""
    if depth > _MAX_DEPTH + 2:
        raise CorruptMetadataError(f"{source}: nesting too deep")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [decode_value(x, source, depth + 1) for x in v]
    if not isinstance(v, dict):
        raise CorruptMetadataError(f"{source}: unexpected JSON value {type(v).__name__}")
    if _TAG not in v:
        return {k: decode_value(x, source, depth + 1) for k, x in v.items()}
    tag = v[_TAG]
    try:
        return _decode_tagged(tag, v, source, depth)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError) as e:
        if isinstance(e, CorruptMetadataError):
            raise
        raise CorruptMetadataError(f"{source}: bad {str(tag)[:40]!r} entry ({e.__class__.__name__}: {e})") from None


def _decode_tagged(tag: Any, v: dict[str, Any], source: str, depth: int) -> Any:
    def sub(x: Any) -> Any:
        return decode_value(x, source, depth + 1)

    if tag == "tuple":
        return tuple(sub(x) for x in _list(v["v"]))
    if tag in ("intdict", "odict"):
        out: dict[Any, Any] = {} if tag == "intdict" else OrderedDict()
        for k, x in (_pair(p) for p in _list(v["v"])):
            if type(k) is not int and (tag == "intdict" or type(k) is not str):
                raise ValueError(f"key {k!r} has the wrong type")
            if k in out:
                raise ValueError(f"key {k!r} twice")
            out[k] = sub(x)
        return out
    if tag in ("set", "frozenset"):
        items = [sub(x) for x in _list(v["v"])]
        return set(items) if tag == "set" else frozenset(items)
    if tag == "bigint":
        if not isinstance(v["v"], str) or not _BIGINT.fullmatch(v["v"]):
            raise ValueError("not a decimal integer")
        return int(v["v"])
    if tag == "float":
        return _float(v)
    if tag == "complex":
        re_im = [sub(x) for x in _list(v["v"])]
        if len(re_im) != 2 or not all(type(x) is float for x in re_im):
            raise ValueError("a complex number is [real, imag] floats")
        return complex(*re_im)
    if tag == "bytes":
        return _b64(v["v"])
    if tag == "bytearray":
        return bytearray(_b64(v["v"]))
    if tag == "size":
        return torch.Size(_shape(v["v"], lo=-(1 << 63)))
    if tag == "torch_dtype":
        return _torch_dtype(v["v"])
    if tag == "device":
        if not _DEVICE.fullmatch(_str(v["v"])):
            raise ValueError(f"not a device: {v['v'][:40]!r}")
        return torch.device(v["v"])
    if tag == "tensor":
        return _decode_tensor(v)
    if tag == "ndarray":
        return _raw_array(v["v"], _element_dtype(v["dtype"]), _shape(v["shape"]))
    if tag == "npscalar":
        return _raw_array(v["v"], _element_dtype(v["dtype"]), (1,))[0]
    if tag == "np_dtype":
        return npdtype.build(v["v"])
    raise CorruptMetadataError(f"{source}: unknown tag {str(tag)[:40]!r}")


def _decode_tensor(v: dict[str, Any]) -> torch.Tensor:
    dt, shape = _torch_dtype(v["dtype"]), _shape(v["shape"])
    raw = _b64(v["v"])
    if len(raw) != math.prod(shape) * dt.itemsize:
        raise ValueError("tensor byte count does not match its shape")
    if raw:  # a copy: its own, aligned memory
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape).clone()
    else:
        t = torch.empty(shape, dtype=dt)
    requires_grad, parameter = v.get("requires_grad", False), v.get("parameter", False)
    if type(requires_grad) is not bool or type(parameter) is not bool:
        raise ValueError("requires_grad and parameter must be booleans")
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)


def _torch_dtype(name: Any) -> torch.dtype:
    try:
        return dtype_from_name(_str(name))
    except CorruptMetadataError:
        raise ValueError(f"unknown torch dtype {name[:40]!r}") from None


def _element_dtype(desc: Any) -> np.dtype:
    """An array's or scalar's dtype (never a subarray dtype: numpy would change the shape)."""
    dt = npdtype.build(desc)
    if dt.subdtype is not None:
        raise ValueError(f"subarray dtype {dt} cannot be an element type")
    return dt


def _raw_array(data: Any, dt: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    raw = _b64(data)
    if dt.itemsize == 0 or len(raw) != math.prod(shape) * dt.itemsize:
        raise ValueError(f"array byte count {len(raw)} does not match shape {shape} of {dt}")
    out = np.empty(shape, dtype=dt)  # aligned; every byte (padding included) set below
    if raw:
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8)
    return out


def _shape(v: Any, lo: int = 0) -> tuple[int, ...]:
    """A list of at most 64 ints >= ``lo`` whose non-zero product stays below 2^62."""
    if not isinstance(v, list) or len(v) > _MAX_NDIM or not all(type(d) is int and lo <= d < 1 << 63 for d in v):
        raise ValueError(f"bad shape {str(v)[:80]}")
    if math.prod(max(abs(d), 1) for d in v) >= _NUMEL_CAP:
        raise ValueError(f"shape {v} is absurdly large")
    return tuple(v)


def _float(v: dict[str, Any]) -> float:
    if not isinstance(v["v"], str) or v["v"] not in ("inf", "-inf", "nan"):
        raise ValueError(f"not a non-finite float: {str(v['v'])[:40]!r}")
    return float(v["v"])


def _b64(v: Any) -> bytes:
    return base64.b64decode(_str(v), validate=True)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return v


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError(f"expected a list, got {type(v).__name__}")
    return v


def _pair(v: Any) -> tuple[Any, Any]:
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError("expected a [key, value] pair")
    return v[0], v[1]


MAX_VALUES = 1 << 24  # values (containers and leaves) of one saved value, every reference counted
MAX_VALUE_BYTES = 1 << 34  # its bytes as written (about: strings, base64 of raw data), every reference counted
_CONTAINERS = (dict, list, tuple, OrderedDict, set, frozenset)


def check_size(v: Any, path: str, tensors_inline: bool = True) -> tuple[int, int]:
    """(values, bytes) that ``encode_value(v)`` would write, every reference to a shared list,
    dict or tuple counted again (the encoding has no references): computed once per container,
    so a state whose sub-structures are shared (``d = [d, d]`` 40 deep: 2^41 values) is measured
    at once instead of walked. ``SizeLimitError`` naming ``path`` over ``MAX_VALUES`` /
    ``MAX_VALUE_BYTES``; TypeError for a container that contains itself or nesting deeper than
    the encoder takes. ``tensors_inline=False``: tensors are saved apart (a ``Stateful``'s) and
    count as one value without bytes. Called by ``dumps_value`` and ``state.tree.split_tensors``
    before they walk."""
    memo: dict[int, tuple[int, int]] = {}
    open_ids: set[int] = set()

    def leaf_bytes(x: Any) -> int:
        if type(x) is str:
            return len(x) + 2
        if type(x) in (bytes, bytearray):
            return len(x) * 4 // 3 + 40
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size() * 4 // 3 + 80 if tensors_inline else 0
        if isinstance(x, np.ndarray):
            return x.nbytes * 4 // 3 + 80
        return 8

    def measure(x: Any, depth: int) -> tuple[int, int]:
        if type(x) not in _CONTAINERS:
            return 1, leaf_bytes(x)
        known = memo.get(id(x))
        if known is not None:
            return known
        if id(x) in open_ids:
            raise _refuse(path, f"a {type(x).__name__} contains itself; only trees of values can be saved")
        if depth > _MAX_DEPTH:
            raise _refuse(path, f"nesting deeper than {_MAX_DEPTH}")
        open_ids.add(id(x))
        values, nbytes = 1, 2
        children = x.items() if isinstance(x, dict) else ((None, c) for c in x)
        for k, c in children:
            cv, cb = measure(c, depth + 1)
            values, nbytes = values + cv, nbytes + cb + (len(k) + 3 if type(k) is str else 8)
        open_ids.discard(id(x))
        memo[id(x)] = (values, nbytes)
        return values, nbytes

    values, nbytes = measure(v, 0)
    if values > MAX_VALUES or nbytes > MAX_VALUE_BYTES:
        raise SizeLimitError(
            f"{path} expands to {values} values ({nbytes} bytes) when every reference to a shared list, "
            f"dict or tuple is written out, over the cap of {MAX_VALUES} values ({MAX_VALUE_BYTES} bytes) of "
            "a saved value: refused; save each shared part once, or large data as tensors"
        )
    return values, nbytes


def dumps_value(v: Any, path: str = "extra_state") -> bytes:
    """UTF-8 JSON of ``encode_value(v)`` (strict JSON: non-finite floats are tagged), its size
    checked first (``check_size``)."""
    check_size(v, path)
    return json.dumps(encode_value(v, path), separators=(",", ":"), allow_nan=False).encode("utf-8")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_value(data: bytes, source: str = "extra state") -> Any:
    """The value ``dumps_value`` wrote; CorruptMetadataError naming ``source`` otherwise."""
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, int too long
        raise CorruptMetadataError(f"{source}: not valid JSON ({e.__class__.__name__}: {e})") from None
    return decode_value(doc, source)
