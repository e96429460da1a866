"""The optional finite check (``TieredCheckpointManager(check_finite=True)``): which floating
tensors of a state hold NaN or Inf.

``nonfinite_names(state)`` is called by ``TieredCheckpointManager.save`` on every rank before the
save (it reads each floating tensor once: this rank's shard of a DTensor, ``to_local()``); the
names go with the step into ``replicate.replicate_step``, which records their union in every
host's commit marker. ``decide.choose`` never picks such a step and ``tier.RamTier`` never copies it
to the durable tier; rank 0 warns naming the tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["nonfinite_names"]


def nonfinite_names(state: Any, prefix: str = "", limit: int = 20) -> list[str]:
    """The dotted names of this rank's floating tensors in ``state`` holding NaN/Inf (the first
    ``limit``)."""
    out: list[str] = []
    _walk(state, prefix, out, limit, set())
    return out


def _walk(value: Any, name: str, out: list[str], limit: int, seen: set[int]) -> None:
    if len(out) >= limit or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.is_floating_point() and local.numel() and not bool(torch.isfinite(local).all()):
            out.append(name or "<state>")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            _walk(v, f"{name}.{k}" if name else str(k), out, limit, seen)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(v, f"{name}.{i}" if name else str(i), out, limit, seen)
    elif callable(getattr(value, "state_dict", None)):
        _walk(value.state_dict(), name, out, limit, seen)
