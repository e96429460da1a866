"""Collectives for planning and commit: torch.distributed (gloo) or a single process."""

from __future__ import annotations

import torch.distributed as dist

from .base import Coordinator, Settle, run_stage
from .single import SingleProcessCoordinator
from .torch_dist import CheckpointGroups, TorchDistCoordinator

__all__ = [
    "Coordinator",
    "run_stage",
    "Settle",
    "SingleProcessCoordinator",
    "TorchDistCoordinator",
    "CheckpointGroups",
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
    initialised, else single-process.

    ``timeout``: seconds each collective may wait (default: the job's timeout); ``label``: what
    the collectives are for (``"save of <url>"``), named in their errors."""
    if dist.is_available() and dist.is_initialized():
        return TorchDistCoordinator(groups, group, channel, timeout=timeout, label=label)
    return SingleProcessCoordinator()
