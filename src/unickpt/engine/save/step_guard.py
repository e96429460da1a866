"""Optimizer step guard: lets an async save copy parameters and optimizer state in the background.

The save pipeline asks ``protected_storages`` which tensors only ``optimizer.step()`` modifies
(the optimizer's parameters and its state), has ``StagingPool.stage`` copy those on the snapshot
thread after the call returns, and calls ``SnapshotGuard.guard(optimizer, copied)``. The guard
registers a step pre-hook on that optimizer (once per guard and optimizer; hooks are never
removed: removing a hook while ``step`` iterates its hooks is unsafe): before every ``step()``
of *that* optimizer it waits for the snapshot copies of that optimizer still in flight. So a
checkpoint always holds the values at the save call while forward and backward run alongside
the copy, and one optimizer's step never waits for another optimizer's snapshot (PPO: the
actor's step does not wait for the critic's save). Everything else (buffers, which forward may
change; blobs) is copied in the call.

Each ``Checkpointer`` owns one ``SnapshotGuard``; the hook holds only a weak reference to it.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["SnapshotGuard", "protected_storages", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """The address of the memory block behind ``t`` (0 for none); DTensors by their local shard."""
    local = t.to_local() if isinstance(t, DTensor) else t  # its shard (a view: no copy, no collective)
    return int(local.untyped_storage().data_ptr())


def protected_storages(optimizer: Any) -> set[int]:
    """Storages that only ``optimizer.step()`` writes: its parameters and its state tensors."""
    keys = {storage_key(p) for g in optimizer.param_groups for p in g["params"]}
    for st in optimizer.state.values():
        keys.update(storage_key(v) for v in st.values() if isinstance(v, torch.Tensor))
    keys.discard(0)
    return keys


class SnapshotGuard:
    """Background snapshot copies in flight, per optimizer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: weakref.WeakKeyDictionary[Any, list[Future]] = weakref.WeakKeyDictionary()
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()

    def guard(self, optimizer: Any, copied: Future) -> None:
        """Make ``optimizer.step()`` wait until ``copied`` (a background snapshot) is done."""
        with self._lock:
            pending = [f for f in self._pending.get(optimizer, []) if not f.done()]  # keep no finished ones
            self._pending[optimizer] = [*pending, copied]
            if optimizer not in self._hooked:
                optimizer.register_step_pre_hook(_WaitHook(weakref.ref(self)))
                self._hooked.add(optimizer)

    def wait(self, optimizer: Any = None) -> None:
        """Block until the background snapshots of ``optimizer`` (None: of every optimizer) taken
        so far are complete (errors are reported by the save's handle, not here)."""
        with self._lock:
            if optimizer is None:
                pending = [f for fs in self._pending.values() for f in fs if not f.done()]
            else:
                pending = [f for f in self._pending.get(optimizer, []) if not f.done()]
                self._pending[optimizer] = pending
        for f in pending:
            f.exception()


class _WaitHook:
    """The step pre-hook: waits for its guard's snapshots of the stepping optimizer."""

    def __init__(self, guard: weakref.ref[SnapshotGuard]) -> None:
        self._guard = guard

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guard = self._guard()
        if guard is not None:
            guard.wait(optimizer)
