"""Coordinator over ``torch.distributed``.

Checkpoint traffic runs on two gloo process groups of its own, created once per parent group by
every rank at its first save/load: ``foreground`` for what the calling thread does (planning,
load), ``background`` for what the async save worker does (commit). So background saves never
interleave collectives with the training job's NCCL/gloo collectives nor with a foreground
save/load planning at the same time, and object collectives work on CPU whatever the training
backend is. Objects exchanged here are unickpt's own plan records
between live ranks of one job, never data read from a checkpoint.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["TorchDistCoordinator", "checkpoint_group"]

CHANNELS = ("foreground", "background")
_GROUPS: dict[tuple[int, str], dist.ProcessGroup] = {}
_LOCK = threading.Lock()


def checkpoint_group(parent: dist.ProcessGroup | None = None, channel: str = "foreground") -> dist.ProcessGroup:
    """unickpt's gloo group for ``channel`` beside ``parent`` (default: the world).

    The first call creates the groups of every channel, in a fixed order, so it must be made by
    all ranks of ``parent`` from their main thread (save/load do that)."""
    parent = parent or dist.group.WORLD
    with _LOCK:
        if (id(parent), channel) not in _GROUPS:
            ranks = dist.get_process_group_ranks(parent)
            for ch in CHANNELS:
                _GROUPS[(id(parent), ch)] = dist.new_group(ranks=ranks, backend="gloo")
        return _GROUPS[(id(parent), channel)]


class TorchDistCoordinator:
    def __init__(self, group: dist.ProcessGroup | None = None, channel: str = "foreground") -> None:
        self.group = checkpoint_group(group, channel)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._global_ranks = dist.get_process_group_ranks(self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self._global_ranks[dst], group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global_ranks[src], group=self.group)
        return box[0]

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == src else None, src=self._global_ranks[src], group=self.group)
        return out[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        # None only for a rank outside ``group``; this rank is always in its own group
        return cast("dist.Work", dist.isend(tensor, dst=self._global_ranks[dst], group=self.group, tag=tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        # None only for a rank outside ``group``; this rank is always in its own group
        return cast("dist.Work", dist.irecv(tensor, src=self._global_ranks[src], group=self.group, tag=tag))
