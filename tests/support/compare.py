"""The tests' one tensor comparison: what "the same" means when a test compares what it loaded
with what it saved (torch only; nothing here imports unickpt).

- :func:`same_tensor`: same dtype, same shape, ``torch.equal`` elements (a NaN is not equal to
  itself, ``0.0 == -0.0``).
- :func:`same_bits`: same dtype, same shape, same bytes (bit-exact: NaN payloads and signed zeros
  count).
- :func:`same_state`: two ``{name: tensor}`` mappings with the same keys, each pair the same by one
  of the two above (``bits=True`` for bytes).
- :func:`assert_same_tree`: nested dicts / lists / tuples of tensors and plain values, asserting
  with the path of the first difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and shape, equal elements (``torch.equal``; NaN never equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and shape, the same bytes (NaN-safe: compares the raw bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], *, bits: bool = False) -> bool:
    """Same keys, and each tensor :func:`same_tensor` (``bits=True``: :func:`same_bits`)."""
    same = same_bits if bits else same_tensor
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def assert_same_tree(a: Any, b: Any, where: str = "", *, strict_types: bool = False) -> None:
    """Assert ``a`` and ``b`` are the same nesting of dicts (same keys), lists / tuples (same
    lengths), tensors (:func:`same_tensor`) and plain values (``==``); ``strict_types`` also
    requires the same type of each sequence and plain value."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and same_tensor(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}", strict_types=strict_types)
    elif isinstance(a, (list, tuple)):
        assert (not strict_types or type(a) is type(b)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]", strict_types=strict_types)
    else:
        assert (not strict_types or type(a) is type(b)) and a == b, f"{where}: {a!r} != {b!r}"
