"""Stable dtype names written into checkpoints (never ``repr(torch.dtype)`` or module paths).

The names and their item sizes are a plain table (``itemsize``, ``DTYPE_NAMES``), so that
decoding and validating metadata never imports torch (``unickpt inspect`` / ``ls`` run without
it); ``dtype_name`` / ``dtype_from_name``, which take or give a ``torch.dtype``, import torch on
first call.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..errors import CorruptMetadataError

if TYPE_CHECKING:
    import torch

__all__ = ["dtype_name", "dtype_from_name", "itemsize", "DTYPE_NAMES"]

# every dtype name checkpoints may use, with its size in bytes (torch >= 2.6 has them all)
_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}
DTYPE_NAMES: tuple[str, ...] = tuple(_ITEMSIZE)


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """name -> torch.dtype and back, built on first use (the one place this module imports torch)."""
    import torch

    to_dtype = {name: getattr(torch, name) for name in DTYPE_NAMES if hasattr(torch, name)}
    return to_dtype, {dt: name for name, dt in to_dtype.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise TypeError(f"unickpt cannot store tensors of dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _torch_tables()[0][name]
    except KeyError:
        raise CorruptMetadataError(f"unknown dtype {name!r} in checkpoint metadata") from None


def itemsize(name: str) -> int:
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise CorruptMetadataError(f"unknown dtype {name!r} in checkpoint metadata") from None
