"""Collectives for planning and commit: torch.distributed (gloo) or a single process."""

from __future__ import annotations

import torch.distributed as dist

from .base import Coordinator, Settle, run_stage
from .single import SingleProcessCoordinator
from .torch_dist import GROUPS, CheckpointGroups, TorchDistCoordinator, checkpoint_group

__all__ = [
    "Coordinator",
    "run_stage",
    "Settle",
    "SingleProcessCoordinator",
    "TorchDistCoordinator",
    "checkpoint_group",
    "CheckpointGroups",
    "GROUPS",
    "make_coordinator",
]


def make_coordinator(
    group: dist.ProcessGroup | None = None,
    channel: str = "foreground",
    *,
    timeout: float | None = None,
    label: str = "unickpt",
) -> Coordinator:
    """TorchDist when a process group is initialised, else single-process.

    ``timeout``: seconds each collective may wait (default: the job's timeout); ``label``: what
    the collectives are for (``"save of <url>"``), named in their errors."""
    if dist.is_available() and dist.is_initialized():
        return TorchDistCoordinator(group, channel, timeout=timeout, label=label)
    return SingleProcessCoordinator()
