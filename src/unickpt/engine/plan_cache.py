"""The plan stage of a save and the plan cache (owned by a ``Checkpointer``).

``plan_stage`` is a collective on the checkpointer's foreground group, called by the save
pipeline after the describe stage: one all_gather tells whether every rank's cached plan is
still valid (and carries rank 0's fresh random save id); if not, the local plans are gathered
(compact bytes, ``planning.save.wire``), rank 0 decodes them and computes the global plan
(``planning.save.plan_save``: dedup, worst-fit balancing, byte layout) and scatters each rank
its own part; every rank keeps its part (rank 0 also the global plan) in its ``PlanCache``
under a ``PlanKey``, so later saves of the same layout only pay that one all_gather (plans name
files by rank and part: the new save id is set, nothing renamed).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, replace

from ..coordination.base import Coordinator
from ..errors import CheckpointError, InternalError
from ..format.checksums import auto_chunk, is_chunk_size
from ..format.dtypes import itemsize
from ..planning.save.model import GlobalSavePlan, LocalSavePlan, RankSavePlan
from ..planning.save.plan import plan_save
from ..planning.save.wire import LocalPlans, decode_rank_plan, encode_local_plan, encode_rank_rows

__all__ = ["PlanKey", "CachedPlan", "PlanCache", "plan_stage", "new_save_id", "checksum_chunk_of"]


def new_save_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:12]


@dataclass(frozen=True, slots=True)
class PlanKey:
    """What a cached plan was made for, beside the local plans themselves: the role, the adapter
    and every option that changes the layout of the files or what the plan decides. Today that
    is ``SaveOptions.files_per_rank`` and ``SaveOptions.checksum_chunk_bytes`` (``io_threads``,
    ``cleanup_previous``, ``background_snapshot`` and ``timeout`` do not change the plan); a new
    such option must be added here."""

    role: str | None
    framework: str
    files_per_rank: int
    checksum_chunk_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """A plan kept for reuse while this rank's local plan stays the same: this rank's own part
    (``mine``) on every rank, and the global plan on the coordinator only (``coordinator``,
    rank 0, which builds the metadata from it at the commit).

    Plans name files by (rank, part), so reuse only gives the plan the save id rank 0 drew for
    this save (``<base>-<seq>-<token>``: the ``base`` shows which plan was reused, the random
    token makes every id unpredictable): ``next`` for this rank's part, ``global_plan`` for the
    coordinator's (at the commit, on the background thread)."""

    local: LocalSavePlan
    mine: RankSavePlan
    coordinator: GlobalSavePlan | None
    base: str
    chunk: int  # the checksum chunk every rank writes with (the coordinator's choice: plan_stage)
    seq: int = 0

    def next(self, token: str) -> CachedPlan:
        seq = self.seq + 1
        mine = replace(self.mine, save_id=f"{self.base}-{seq:06d}-{token}")
        return replace(self, mine=mine, seq=seq)

    @property
    def save_id(self) -> str:
        return self.mine.save_id

    def global_plan(self) -> GlobalSavePlan:
        """The coordinator's global plan under this save's id (rank 0 only)."""
        if self.coordinator is None:
            raise InternalError("only the coordinator (rank 0) holds the global save plan")
        return self.coordinator.with_save_id(self.save_id)


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
    coord: Coordinator,
    local: LocalSavePlan,
    files_per_rank: int,
    cached: CachedPlan | None = None,
    checksum_chunk: int | None = None,
) -> CachedPlan:
    """Collective (foreground group): this save's global plan, from the cache when every rank's
    local plan is unchanged (one tiny all_gather, which also carries rank 0's fresh random save
    id), else gathered and computed by rank 0, which also decides the checksum chunk every rank
    writes with (``checksum_chunk``, rank 0's ``SaveOptions.checksum_chunk_bytes``; None: by the
    size of the checkpoint's tensors, ``format.checksums.auto_chunk``) and sends it with each
    rank's part."""
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
    # own part of the global plan (planning.save.wire; O(its entries), not O(the job)); the
    # coordinator decodes a rank's table when the planner asks for it (wire.LocalPlans) and
    # keeps its own part as it is
    if coord.world_size == 1:
        gplan = plan_save([local], save_id, files_per_rank)
        return CachedPlan(local, gplan.rank_plans[0], gplan, save_id, checksum_chunk_of(gplan, checksum_chunk))
    encoded = coord.gather_object(encode_local_plan(local))
    parts: list[object] | None = None
    coordinator: GlobalSavePlan | None = None
    if coord.rank == 0:
        assert encoded is not None
        try:
            coordinator = plan_save(LocalPlans(encoded), save_id, files_per_rank)  # type: ignore[arg-type]
            chunk = checksum_chunk_of(coordinator, checksum_chunk)
            parts = [
                (chunk, b""),
                *((chunk, encode_rank_rows(r, save_id, *coordinator.rank_rows(r))) for r in range(1, coord.world_size)),
            ]
        except CheckpointError as e:
            parts = [e] * coord.world_size
    received = coord.scatter_object(parts)
    if isinstance(received, CheckpointError):
        raise received
    if (
        not isinstance(received, tuple)
        or len(received) != 2
        or not is_chunk_size(received[0])
        or not isinstance(received[1], bytes)
    ):
        raise InternalError(f"rank {coord.rank} received no usable part of the save plan ({type(received).__name__})")
    chunk, rows = received
    if coordinator is not None:
        return CachedPlan(local, coordinator.rank_plans[0], coordinator, save_id, chunk)
    mine = decode_rank_plan(rows)
    if mine.rank != coord.rank:
        raise InternalError(f"rank {coord.rank} received the save plan of rank {mine.rank}")
    return CachedPlan(local, mine, None, save_id, chunk)


def checksum_chunk_of(gplan: GlobalSavePlan, asked: int | None) -> int:
    """The checksum chunk of this save: the one asked for, else ``auto_chunk`` of the bytes of
    the checkpoint's tensors (each saved once; blobs are small and not counted)."""
    if asked is not None:
        return asked
    return auto_chunk(sum(math.prod(shape) * itemsize(dtype) for dtype, shape in gplan.tensors.values()))
