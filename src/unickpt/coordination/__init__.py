"""Collectives for planning and commit: torch.distributed (gloo), flat or shaped as a tree above
a world size (``CoordinationOptions``), or a single process; the commit barrier (``barrier``)."""

from __future__ import annotations

import torch.distributed as dist

from .barrier import commit_barrier
from .base import Coordinator, Settle, run_stage
from .single import SingleProcessCoordinator
from .topology import CoordinationOptions, TreeLayout
from .torch_dist import CheckpointGroups, TorchDistCoordinator
from .tree import TreeCoordinator

__all__ = [
    "Coordinator",
    "run_stage",
    "Settle",
    "SingleProcessCoordinator",
    "TorchDistCoordinator",
    "CheckpointGroups",
    "CoordinationOptions",
    "TreeCoordinator",
    "TreeLayout",
    "commit_barrier",
    "make_coordinator",
]


def make_coordinator(
    groups: CheckpointGroups,
    group: dist.ProcessGroup | None = None,
    channel: str = "foreground",
    *,
    timeout: float | None = None,
    label: str = "unickpt",
) -> Coordinator:
    """TorchDist (on ``groups``' gloo groups beside ``group``) when a process group is
    initialised, as a tree when ``groups`` made one for ``group`` (its world size reached
    ``CoordinationOptions.tree_min_world_size``), else single-process.

    ``timeout``: seconds each collective may wait (default: the job's timeout); ``label``: what
    the collectives are for (``"save of <url>"``), named in their errors."""
    if dist.is_available() and dist.is_initialized():
        flat = TorchDistCoordinator(groups, group, channel, timeout=timeout, label=label)
        tree = flat.channel.tree
        if tree is None:
            return flat
        return TreeCoordinator(
            tree.layout, flat.rank, tree.links, flat, guard=flat, timeout=flat.timeout.total_seconds()
        )
    return SingleProcessCoordinator()
