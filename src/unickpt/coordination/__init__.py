"""Collectives for planning and commit: torch.distributed (gloo), flat or shaped as a tree above
a world size (``CoordinationOptions``), or a single process; the commit barrier (``barrier``).

The pipelines see only the ``base.Coordinator`` protocol and ``run_stage`` (one stage, the same
outcome on every rank: ``outcomes``), so a job of one process, of a flat group and of a tree
(``tree`` over ``topology``) run the same code. ``torch_dist`` and ``single`` implement it;
``store`` and ``barrier`` carry the commit's reports without a collective; ``waits`` warns which
ranks a wait is missing.

The names below are imported from their modules on first access (``__getattr__``), so that the
torch-free modules (``single``, ``topology``, ``base``) import without torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..errors import NoProcessGroupError

if TYPE_CHECKING:
    import torch.distributed as dist

    from .barrier import commit_barrier
    from .base import Coordinator, Settle, Share, run_stage
    from .single import SingleProcessCoordinator
    from .topology import CoordinationOptions, TreeLayout
    from .torch_dist import CheckpointGroups, TorchDistCoordinator
    from .tree import TreeCoordinator

__all__ = [
    "Coordinator",
    "run_stage",
    "Settle",
    "Share",
    "SingleProcessCoordinator",
    "TorchDistCoordinator",
    "CheckpointGroups",
    "CoordinationOptions",
    "TreeCoordinator",
    "TreeLayout",
    "commit_barrier",
    "make_coordinator",
]

_LAZY = {
    "commit_barrier": ".barrier",
    "Coordinator": ".base",
    "Settle": ".base",
    "Share": ".base",
    "run_stage": ".base",
    "SingleProcessCoordinator": ".single",
    "CoordinationOptions": ".topology",
    "TreeLayout": ".topology",
    "CheckpointGroups": ".torch_dist",
    "TorchDistCoordinator": ".torch_dist",
    "TreeCoordinator": ".tree",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


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
    import torch.distributed as dist

    from .single import SingleProcessCoordinator
    from .torch_dist import TorchDistCoordinator
    from .tree import TreeCoordinator

    if dist.is_available() and dist.is_initialized():
        flat = TorchDistCoordinator(groups, group, channel, timeout=timeout, label=label)
        tree = flat.channel.tree
        if tree is None:
            return flat
        return TreeCoordinator(
            tree.layout, flat.rank, tree.links, flat, guard=flat, timeout=flat.timeout.total_seconds()
        )
    _refuse_launched_ranks_without_group(label)
    return SingleProcessCoordinator()


def _refuse_launched_ranks_without_group(label: str) -> None:
    """``NoProcessGroupError`` when this process is one of several launched ranks (``WORLD_SIZE``
    > 1, set by ``torchrun`` and other launchers) but no process group is initialised: as one
    process each rank would save (or plan a load) alone, racing the others on one folder."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    if not world.isdigit() or int(world) <= 1:
        return
    rank = os.environ.get("RANK", "?")
    raise NoProcessGroupError(
        f"{label}: this process is rank {rank} of WORLD_SIZE={world} (set by torchrun or another "
        "launcher) but torch.distributed's process group is not initialised, so every rank would "
        "act alone on the same checkpoint; call torch.distributed.init_process_group() on every rank "
        "before saving or loading (or unset WORLD_SIZE for a single-process job)"
    )
