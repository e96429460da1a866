"""Optimizer step guard: lets an async save copy parameters and optimizer state in the background.

``api.save(async_save=True)`` asks ``protected_storages`` which tensors only ``optimizer.step()``
modifies (the optimizer's parameters and its state), has ``StagingPool.stage`` copy those on the
snapshot thread after the call returns, and calls ``guard(optimizer, copied)``. The guard is a
step pre-hook, registered once per optimizer and never removed (removing a hook while ``step``
iterates its hooks is unsafe): before every ``step()`` it waits for the snapshot copies still in
flight, so a checkpoint always holds the values at the save call while forward and backward run
alongside the copy. Everything else (buffers, which forward may change; blobs) is copied in
the call.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from typing import Any

import torch

__all__ = ["guard", "protected_storages", "wait_pending", "storage_key"]

_LOCK = threading.Lock()
_PENDING: list[Future] = []
_GUARDED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def storage_key(t: torch.Tensor) -> int:
    """The address of the memory block behind ``t`` (0 for none); DTensors by their local shard."""
    local = getattr(t, "_local_tensor", t)  # DTensor -> its shard (no collective)
    return int(local.untyped_storage().data_ptr())


def protected_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    """Storages that only ``optimizer.step()`` writes: its parameters and its state tensors."""
    keys = {storage_key(p) for g in optimizer.param_groups for p in g["params"]}
    for st in optimizer.state.values():
        keys.update(storage_key(v) for v in st.values() if isinstance(v, torch.Tensor))
    keys.discard(0)
    return keys


def guard(optimizer: torch.optim.Optimizer, copied: Future) -> None:
    """Make ``optimizer.step()`` wait until ``copied`` (a background snapshot) is done."""
    with _LOCK:
        _PENDING[:] = [f for f in _PENDING if not f.done()] + [copied]  # keep no finished ones
        if optimizer not in _GUARDED:
            optimizer.register_step_pre_hook(_before_step)
            _GUARDED.add(optimizer)


def wait_pending() -> None:
    """Block until every background snapshot taken so far is complete (errors are reported by
    the save's handle, not here)."""
    with _LOCK:
        pending = [f for f in _PENDING if not f.done()]
        _PENDING[:] = pending
    for f in pending:
        f.exception()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    wait_pending()
