"""Brute-force checks of boxes (offsets, lengths) inside a tensor shape, with numpy only: the
oracle for tests of the planners and of saved checkpoints (small shapes: one counter per
element)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["coverage", "tiles_exactly", "element_size", "numel"]

Box = tuple[Sequence[int], Sequence[int]]


def coverage(shape: Sequence[int], boxes: Sequence[Box]) -> np.ndarray | None:
    """How many boxes cover each element of ``shape``; None when a box reaches outside it."""
    counts = np.zeros(tuple(shape), dtype=np.int64)
    for offsets, lengths in boxes:
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            return None
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
            return None
        counts[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
    return counts


def tiles_exactly(shape: Sequence[int], boxes: Sequence[Box]) -> bool:
    """Every element of ``shape`` is in exactly one box, and no box reaches outside it."""
    counts = coverage(shape, boxes)
    return counts is not None and bool((counts == 1).all())


def element_size(dtype_name: str) -> int:
    """Bytes per element of the torch dtype called ``dtype_name`` (``"float32"``, ``"bfloat16"``)."""
    dtype = getattr(torch, dtype_name)
    assert isinstance(dtype, torch.dtype), dtype_name
    return torch.empty((), dtype=dtype).element_size()


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
