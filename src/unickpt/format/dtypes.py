"""Stable dtype names written into checkpoints (never ``repr(torch.dtype)`` or module paths)."""

from __future__ import annotations

import torch

from ..errors import CorruptMetadataError

__all__ = ["dtype_name", "dtype_from_name", "itemsize", "DTYPE_NAMES"]

_NAME_TO_DTYPE: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _NAME_TO_DTYPE[_name] = getattr(torch, _name)
_DTYPE_TO_NAME = {dt: name for name, dt in _NAME_TO_DTYPE.items()}
DTYPE_NAMES: tuple[str, ...] = tuple(_NAME_TO_DTYPE)  # every dtype name checkpoints may use


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_TO_NAME[dtype]
    except KeyError:
        raise TypeError(f"unickpt cannot store tensors of dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _NAME_TO_DTYPE[name]
    except KeyError:
        raise CorruptMetadataError(f"unknown dtype {name!r} in checkpoint metadata") from None


def itemsize(name: str) -> int:
    return dtype_from_name(name).itemsize
