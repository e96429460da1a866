"""Coordinator over ``torch.distributed``.

Checkpoint traffic runs on its own gloo process group (created once per parent group, by every
rank, in the order ranks first call save/load), so that background saves never interleave their
collectives with the training job's NCCL/gloo collectives, and so that object collectives work on
CPU whatever the training backend is. Objects exchanged here are unickpt's own plan records
between live ranks of one job, never data read from a checkpoint.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

__all__ = ["TorchDistCoordinator", "checkpoint_group"]

_GROUPS: dict[int, dist.ProcessGroup] = {}
_LOCK = threading.Lock()


def checkpoint_group(parent: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The gloo group unickpt uses beside ``parent`` (default: the world). Collective on first use."""
    parent = parent or dist.group.WORLD
    key = id(parent)
    with _LOCK:
        group = _GROUPS.get(key)
        if group is None:
            ranks = dist.get_process_group_ranks(parent)
            if dist.get_backend(parent) == "gloo":
                group = parent
            else:
                group = dist.new_group(ranks=ranks, backend="gloo")
            _GROUPS[key] = group
        return group


class TorchDistCoordinator:
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = checkpoint_group(group)
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
        dist.scatter_object_list(out, objs if self.rank == src else None,
                                 src=self._global_ranks[src], group=self.group)
        return out[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)
