"""The plan stage of a save and the plan cache (owned by a ``Checkpointer``).

``plan_stage`` is a collective on the checkpointer's foreground group, called by the save
pipeline after the describe stage: one all_gather tells whether every rank's cached plan is
still valid (and carries rank 0's fresh random save id); if not, the local plans are gathered
(compact bytes, ``planning.plan_codec``), rank 0 computes the global plan
(``planning.save_plan.plan_save``: dedup, worst-fit balancing, byte layout) and scatters each
rank its own part; every rank keeps its part (rank 0 also the global plan) in its
``PlanCache`` under a ``PlanKey``, so later saves of the same layout only pay that one
all_gather and a rename of the rank's own entries.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from ..coordination.base import Coordinator
from ..errors import CheckpointError, PlanningError
from ..planning.plan_codec import decode_local_plan, decode_rank_plan, encode_local_plan, encode_rank_plan
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
    """A plan kept for reuse while this rank's local plan stays the same: this rank's own part
    (``mine``) on every rank, and the global plan on the coordinator only (``coordinator``,
    rank 0, which builds the metadata from it at the commit).

    Reuse renames the files under the save id rank 0 drew for this save (``<base>-<seq>-<token>``:
    the ``base`` shows which plan was reused, the random token makes every id unpredictable).
    ``next`` renames ``mine`` only: O(this rank's entries), whatever the world size; the
    coordinator's global plan is renamed when the commit asks for it (``global_plan``, on the
    background thread), never in the blocking part of a save."""

    local: LocalSavePlan
    mine: RankSavePlan
    coordinator: GlobalSavePlan | None
    base: str
    seq: int = 0

    def next(self, token: str) -> CachedPlan:
        seq = self.seq + 1
        save_id = f"{self.base}-{seq:06d}-{token}"
        return CachedPlan(self.local, _rename_rank_plan(self.mine, save_id), self.coordinator, self.base, seq)

    @property
    def save_id(self) -> str:
        return self.mine.save_id

    def global_plan(self) -> GlobalSavePlan:
        """The coordinator's global plan under this save's id (rank 0 only)."""
        if self.coordinator is None:
            raise PlanningError("only the coordinator (rank 0) holds the global save plan")
        if self.coordinator.save_id == self.save_id:
            return self.coordinator
        return _rename_plan(self.coordinator, self.save_id)


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
    # local plans travel to the coordinator as compact bytes, and each rank gets back only its
    # own part of the global plan (planning.plan_codec; O(its entries), not O(the job))
    encoded = coord.gather_object(encode_local_plan(local)) if coord.world_size > 1 else [encode_local_plan(local)]
    parts: list[object] | None = None
    gplan: GlobalSavePlan | None = None
    if coord.rank == 0:
        assert encoded is not None
        try:
            gplan = plan_save([decode_local_plan(b) for b in encoded], save_id, files_per_rank)
            parts = [encode_rank_plan(rp) for rp in gplan.rank_plans]
        except CheckpointError as e:
            parts = [e] * coord.world_size
    received = coord.scatter_object(parts) if coord.world_size > 1 else (parts or [None])[0]
    if isinstance(received, CheckpointError):
        raise received
    mine = decode_rank_plan(received)  # type: ignore[arg-type]
    if mine.rank != coord.rank:
        raise PlanningError(f"rank {coord.rank} received the save plan of rank {mine.rank}")
    return CachedPlan(local, mine, gplan, save_id)


def _rename_rank_plan(rp: RankSavePlan, save_id: str) -> RankSavePlan:
    old = rp.save_id
    return RankSavePlan(rp.rank, save_id, tuple(replace(e, file=e.file.replace(old, save_id, 1)) for e in rp.entries))


def _rename_plan(gplan: GlobalSavePlan, save_id: str) -> GlobalSavePlan:
    old = gplan.save_id
    rank_plans = tuple(_rename_rank_plan(rp, save_id) for rp in gplan.rank_plans)
    return replace(
        gplan, save_id=save_id, rank_plans=rank_plans, files=tuple(f.replace(old, save_id, 1) for f in gplan.files)
    )
