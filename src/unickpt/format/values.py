"""Safe encoding of plain Python values, tensors and numpy arrays (extra state, RNG states).

A tagged JSON tree: dicts with string keys, lists, tuples, ints, floats (incl. inf/nan), str,
bytes, None, bool, ``torch.Tensor`` and ``numpy.ndarray`` (raw bytes, base64). Decoding builds
only these types: no pickle, no import of names from the data, so loading never runs code.
Called by ``state.extra`` at save (``encode_value``) and load (``decode_value``).
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import torch

from ..errors import CorruptMetadataError
from .dtypes import dtype_from_name, dtype_name

__all__ = ["encode_value", "decode_value", "dumps_value", "loads_value"]

_TAG = "__unickpt__"
_MAX_DEPTH = 64


def encode_value(v: Any, path: str = "extra_state", depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise TypeError(f"{path}: nesting deeper than {_MAX_DEPTH}")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v if -(1 << 63) <= v < (1 << 64) else {_TAG: "bigint", "v": str(v)}
    if isinstance(v, float):
        return v if math.isfinite(v) else {_TAG: "float", "v": repr(v)}
    if isinstance(v, (bytes, bytearray)):
        return {_TAG: "bytes", "v": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, torch.Tensor):
        t = v.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            _TAG: "tensor",
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "v": base64.b64encode(raw).decode(),
        }
    if isinstance(v, np.ndarray):
        if v.dtype.hasobject:
            raise TypeError(f"{path}: numpy arrays of objects cannot be saved safely")
        a = np.require(v, requirements="C")  # keeps 0-d arrays 0-d (ascontiguousarray does not)
        return {
            _TAG: "ndarray",
            "dtype": a.dtype.str,
            "shape": list(a.shape),
            "v": base64.b64encode(a.tobytes()).decode(),
        }
    if isinstance(v, np.generic):
        return encode_value(v.item(), path, depth + 1)
    if isinstance(v, tuple):
        return {_TAG: "tuple", "v": [encode_value(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [encode_value(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        if v and all(type(k) is int for k in v):
            return {_TAG: "intdict", "v": [[k, encode_value(x, f"{path}[{k}]", depth + 1)] for k, x in v.items()]}
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: dict keys must be all str or all int, got {type(k).__name__}")
            if k == _TAG:
                raise TypeError(f"{path}: the key {_TAG!r} is reserved")
            out[k] = encode_value(x, f"{path}.{k}", depth + 1)
        return out
    raise TypeError(
        f"{path}: cannot save a value of type {type(v).__name__}; extra state holds plain values, "
        "tensors and numpy arrays (call state_dict() on objects first)"
    )


def decode_value(v: Any, source: str = "extra state", depth: int = 0) -> Any:
    if depth > _MAX_DEPTH + 2:
        raise CorruptMetadataError(f"{source}: nesting too deep")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [decode_value(x, source, depth + 1) for x in v]
    if not isinstance(v, dict):
        raise CorruptMetadataError(f"{source}: unexpected JSON value {type(v).__name__}")
    tag = v.get(_TAG)
    if tag is None:
        return {k: decode_value(x, source, depth + 1) for k, x in v.items()}
    try:
        if tag == "tuple":
            return tuple(decode_value(x, source, depth + 1) for x in v["v"])
        if tag == "intdict":
            return {int(k): decode_value(x, source, depth + 1) for k, x in v["v"]}
        if tag == "bigint":
            return int(v["v"])
        if tag == "float":
            if v["v"] not in ("inf", "-inf", "nan"):
                raise ValueError(v["v"])
            return float(v["v"])
        if tag == "bytes":
            return base64.b64decode(v["v"], validate=True)
        if tag == "tensor":
            dt = dtype_from_name(v["dtype"])
            shape = [int(d) for d in v["shape"]]
            raw = base64.b64decode(v["v"], validate=True)
            if len(raw) != math.prod(shape) * dt.itemsize:
                raise ValueError("tensor byte count does not match its shape")
            if not raw:
                return torch.empty(shape, dtype=dt)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape).clone()
        if tag == "ndarray":
            ndt = np.dtype(v["dtype"])
            if ndt.hasobject:
                raise ValueError("object arrays are refused")
            nshape = tuple(int(d) for d in v["shape"])
            raw = base64.b64decode(v["v"], validate=True)
            if len(raw) != math.prod(nshape) * ndt.itemsize:
                raise ValueError("array byte count does not match its shape")
            return np.frombuffer(raw, dtype=ndt).reshape(nshape).copy()
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptMetadataError(f"{source}: bad {tag!r} entry ({e})") from None
    raise CorruptMetadataError(f"{source}: unknown tag {tag!r}")


def dumps_value(v: Any, path: str = "extra_state") -> bytes:
    return json.dumps(encode_value(v, path), separators=(",", ":")).encode("utf-8")


def loads_value(data: bytes, source: str = "extra state") -> Any:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptMetadataError(f"{source}: not valid JSON ({e})") from None
    return decode_value(doc, source)
