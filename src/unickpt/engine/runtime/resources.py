"""What the save and load pipelines borrow from the ``Checkpointer`` that runs them.

A ``Checkpointer`` builds one ``Resources`` record at construction and hands it to every
``SavePipeline`` / ``LoadPipeline`` it creates; pipelines own nothing that outlives their call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ...coordination import Coordinator, make_coordinator
from ...coordination.torch_dist import CheckpointGroups
from ...folder.lock_owner import LockContext
from ...monitoring.events import EventBus
from ..load.schedule import ReaderThreads
from ..plan_cache import PlanCache
from ..save.staging import StagingPool
from ..save.step_guard import SnapshotGuard
from .worker import SaveWorker

__all__ = ["Resources"]


@dataclass(frozen=True, slots=True)
class Resources:
    """One checkpointer's long-lived state, as the pipelines use it.

    ``groups`` / ``group``: its gloo groups beside the job's ``group`` (None: the world);
    ``plans``: cached global save plans; ``staging``: file images of async snapshots; ``guard``:
    optimizer step hooks waiting for background snapshot copies; ``worker``: the background
    thread for write + commit and the failure reports of async saves; ``locks``: its save-lock
    tokens; ``events``: its per-phase event listeners; ``readers``: its loads' reader and
    verifier threads, kept between loads."""

    groups: CheckpointGroups
    group: dist.ProcessGroup | None
    plans: PlanCache
    staging: StagingPool
    guard: SnapshotGuard
    worker: SaveWorker
    locks: LockContext
    events: EventBus
    readers: ReaderThreads

    def coordinator(self, channel: str, timeout: float | None, label: str) -> Coordinator:
        """The collectives of one save/load on ``channel`` ("foreground": the caller's thread;
        "background": the worker thread)."""
        return make_coordinator(self.groups, self.group, channel, timeout=timeout, label=label)
