"""Collectives for planning and commit: torch.distributed (gloo) or a single process."""

from __future__ import annotations

import torch.distributed as dist

from .base import Coordinator, run_stage
from .single import SingleProcessCoordinator
from .torch_dist import TorchDistCoordinator, checkpoint_group

__all__ = [
    "Coordinator",
    "run_stage",
    "SingleProcessCoordinator",
    "TorchDistCoordinator",
    "checkpoint_group",
    "make_coordinator",
]


def make_coordinator(group: dist.ProcessGroup | None = None, channel: str = "foreground") -> Coordinator:
    """TorchDist when a process group is initialised, else single-process."""
    if dist.is_available() and dist.is_initialized():
        return TorchDistCoordinator(group, channel)
    return SingleProcessCoordinator()
