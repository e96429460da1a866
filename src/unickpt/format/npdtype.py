"""Safe JSON description of numpy dtypes for the value encoding (``format.values``).

``describe(dtype)`` at save, ``build(description)`` at load. A description is one of:
- a canonical ``dtype.str`` of a plain dtype: ``"<f4"``, ``">i8"``, ``"|b1"``, ``"<c16"``,
  ``"|S5"``, ``"<U3"``, ``"|V12"`` (raw bytes), ``"<M8[ns]"``, ``"<m8[10s]"``;
- ``{"sub": description, "shape": [ints]}``: a subarray dtype (a structured field of shape (2, 3));
- ``{"fields": [[name, description, offset], ...], "itemsize": n, "aligned": bool}``: a structured
  dtype, nested to any depth, with its exact offsets and padding.
``build`` never hands numpy a string it did not check against a closed grammar (a plain dtype
code, no ``"O"``, no comma lists, no type names), builds structured dtypes from already built
field dtypes, and refuses anything that would hold Python objects. Object dtypes, field titles
and dtype metadata are refused at save (they cannot be rebuilt exactly or safely).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

__all__ = ["describe", "build"]

_PLAIN = re.compile(r"[<>|](?:[biufcSUV][0-9]{1,9}|[Mm]8(?:\[[0-9]{0,9}(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?)")
_MAX_DEPTH = 16
_MAX_FIELDS = 4096
_MAX_ITEMSIZE = 1 << 31


def describe(dt: np.dtype, path: str) -> Any:
    """The description of ``dt``; TypeError naming ``path`` if it cannot be saved exactly."""
    if dt.hasobject:
        raise TypeError(f"{path}: numpy arrays of objects cannot be saved safely (dtype {dt})")
    if dt.metadata:
        raise TypeError(f"{path}: numpy dtype {dt} carries metadata, which unickpt cannot restore")
    if dt.subdtype is not None:
        base, shape = dt.subdtype
        return {"sub": describe(base, path), "shape": list(shape)}
    if dt.names is not None and dt.fields is not None:
        fields = []
        for name in dt.names:
            spec = dt.fields[name]
            if len(spec) > 2:
                raise TypeError(f"{path}: numpy field {name!r} has a title, which unickpt cannot restore")
            fields.append([name, describe(spec[0], f"{path} field {name!r}"), spec[1]])
        return {"fields": fields, "itemsize": dt.itemsize, "aligned": bool(dt.isalignedstruct)}
    if not _PLAIN.fullmatch(dt.str) or np.dtype(dt.str) != dt:
        raise TypeError(f"{path}: numpy dtype {dt} ({dt.str}) cannot be saved")
    return dt.str


def build(desc: Any, depth: int = 0) -> np.dtype:
    """The dtype a description names; ValueError for anything ``describe`` would not write."""
    if depth > _MAX_DEPTH:
        raise ValueError("numpy dtype nested too deeply")
    if isinstance(desc, str):
        if not _PLAIN.fullmatch(desc):
            raise ValueError(f"not a plain numpy dtype: {desc[:40]!r}")
        dt = np.dtype(desc)
        if dt.str != desc or dt.hasobject:
            raise ValueError(f"not a canonical numpy dtype: {desc!r}")
        return dt
    if not isinstance(desc, dict):
        raise ValueError(f"numpy dtype description must be a string or an object, got {type(desc).__name__}")
    if "sub" in desc:
        shape = desc["shape"]
        if not isinstance(shape, list) or len(shape) > 32 or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"bad subarray shape {shape!r}")
        base = build(desc["sub"], depth + 1)
        if math.prod(shape) * base.itemsize > _MAX_ITEMSIZE:
            raise ValueError("subarray dtype too large")
        return np.dtype((base, tuple(shape)))
    fields, itemsize, aligned = desc["fields"], desc["itemsize"], desc["aligned"]
    if not isinstance(fields, list) or len(fields) > _MAX_FIELDS:
        raise ValueError("structured dtype fields must be a list")
    if type(itemsize) is not int or not 0 <= itemsize <= _MAX_ITEMSIZE or type(aligned) is not bool:
        raise ValueError(f"bad structured dtype itemsize {itemsize!r} / aligned {aligned!r}")
    names, formats, offsets = [], [], []
    for field in fields:
        if not isinstance(field, list) or len(field) != 3:
            raise ValueError("a structured dtype field must be [name, dtype, offset]")
        name, sub, offset = field
        if not isinstance(name, str) or type(offset) is not int or not 0 <= offset <= _MAX_ITEMSIZE:
            raise ValueError(f"bad structured dtype field {name!r} at {offset!r}")
        names.append(name)
        formats.append(build(sub, depth + 1))
        offsets.append(offset)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize}, align=aligned)
