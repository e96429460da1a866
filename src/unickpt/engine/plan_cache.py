"""The plan stage of a save and the plan cache (owned by a ``Checkpointer``).

``plan_stage`` is a collective on the checkpointer's foreground group, called by the save
pipeline after the describe stage: one all_gather tells whether every rank's cached plan is
still valid (and carries rank 0's fresh random save id); if not, the local plans are gathered,
rank 0 computes the global plan (``planning.save_plan.plan_save``: dedup, worst-fit balancing,
byte layout) and broadcasts it, and every rank keeps it in its ``PlanCache`` under a
``PlanKey``, so later saves of the same layout only pay that one all_gather.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from ..coordination.base import Coordinator
from ..errors import CheckpointError
from ..planning.save_plan import GlobalSavePlan, LocalSavePlan, RankSavePlan, plan_save

__all__ = ["PlanKey", "CachedPlan", "PlanCache", "plan_stage", "new_save_id"]


def new_save_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:12]


@dataclass(frozen=True, slots=True)
class PlanKey:
    """What a cached plan was made for, beside the local plans themselves: the role, the adapter
    and every option that changes the layout of the files. Today that is only
    ``SaveOptions.files_per_rank`` (``io_threads``, ``cleanup_previous``, ``background_snapshot``
    and ``timeout`` do not change the plan); a new layout option must be added here."""

    role: str | None
    framework: str
    files_per_rank: int


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """A global plan kept for reuse while this rank's local plan stays the same.

    Reuse renames the files under the save id rank 0 drew for this save (``<base>-<seq>-<token>``:
    the ``base`` shows which plan was reused, the random token makes every id unpredictable)."""

    local: LocalSavePlan
    plan: GlobalSavePlan
    base: str
    seq: int = 0

    def next(self, token: str) -> CachedPlan:
        seq = self.seq + 1
        return CachedPlan(self.local, _rename_plan(self.plan, f"{self.base}-{seq:06d}-{token}"), self.base, seq)


class PlanCache:
    """Global plans by ``PlanKey``, reused while every rank's local plan is unchanged. Each
    ``Checkpointer`` owns one."""

    def __init__(self) -> None:
        self._plans: dict[PlanKey, CachedPlan] = {}

    def get(self, key: PlanKey) -> CachedPlan | None:
        return self._plans.get(key)

    def put(self, key: PlanKey, plan: CachedPlan) -> None:
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()


def plan_stage(
    coord: Coordinator, local: LocalSavePlan, files_per_rank: int, cached: CachedPlan | None = None
) -> CachedPlan:
    """Collective (foreground group): this save's global plan, from the cache when every rank's
    local plan is unchanged (one tiny all_gather, which also carries rank 0's fresh random save
    id), else gathered and computed by rank 0."""
    unchanged = cached is not None and cached.local == local
    save_id = new_save_id()
    if coord.world_size > 1:
        votes = coord.all_gather_object((unchanged, save_id if coord.rank == 0 else None))
        unchanged = all(v for v, _ in votes)
        save_id = votes[0][1]
    if unchanged:
        assert cached is not None
        return cached.next(save_id.rsplit("-", 1)[-1])
    plans = coord.gather_object(local)
    payload: object = None
    if coord.rank == 0:
        assert plans is not None
        try:
            payload = plan_save(plans, save_id, files_per_rank)
        except CheckpointError as e:
            payload = e
    # every rank keeps the global plan so later saves reuse it without gathering
    payload = coord.broadcast_object(payload) if coord.world_size > 1 else payload
    if isinstance(payload, CheckpointError):
        raise payload
    assert isinstance(payload, GlobalSavePlan)
    return CachedPlan(local, payload, save_id)


def _rename_plan(gplan: GlobalSavePlan, save_id: str) -> GlobalSavePlan:
    old = gplan.save_id
    rank_plans = tuple(
        RankSavePlan(rp.rank, save_id, tuple(replace(e, file=e.file.replace(old, save_id, 1)) for e in rp.entries))
        for rp in gplan.rank_plans
    )
    return replace(
        gplan, save_id=save_id, rank_plans=rank_plans, files=tuple(f.replace(old, save_id, 1) for f in gplan.files)
    )
