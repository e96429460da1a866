"""Snapshot staging: turn the items a rank writes into byte buffers that stay valid while writing.

A blocking save writes straight from the live tensors (zero copy). An asynchronous save must
snapshot them first: each written item is copied into host memory so training may continue.
"""

from __future__ import annotations

import torch

from ..planning.specs import SaveItem
from ..storage.base import Buffer
from .bytes_view import tensor_bytes

__all__ = ["stage_items"]


def stage_items(items: list[SaveItem], written: set[int], *, copy: bool) -> list[Buffer]:
    """Byte buffers for the written items (index-aligned with ``items``; others are empty)."""
    out: list[Buffer] = [b""] * len(items)
    with torch.no_grad():
        for i in written:
            t = items[i].tensor
            if copy or t.device.type != "cpu":
                t = t.detach().to("cpu", copy=True).contiguous() if copy else t.detach().cpu()
            out[i] = tensor_bytes(t)
    return out
