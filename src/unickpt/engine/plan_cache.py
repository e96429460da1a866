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

import math
import time
import uuid
from dataclasses import dataclass, field, replace

from ..coordination.base import Coordinator
from ..errors import CheckpointError, InternalError
from ..format.checksums import auto_chunk, is_chunk_size
from ..format.dtypes import itemsize
from ..planning.plan_codec import decode_rank_plan, encode_local_plan, encode_rank_rows
from ..planning.regular_plan import RegularRankPlans
from ..planning.save_plan import GlobalSavePlan, LocalSavePlan, RankSavePlan, WriteEntry, plan_save, rank_plan_rows

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
class _Columns:
    """A rank plan's entries by column, files by index: renaming the plan is one new name per
    file and one ``WriteEntry`` per entry (no per-entry string work, no ``dataclasses.replace``)."""

    rank: int
    save_id: str
    files: tuple[str, ...]
    items: tuple[int, ...]
    file_index: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    blobs: tuple[str, ...]

    @classmethod
    def of(cls, rp: RankSavePlan) -> _Columns:
        files, rows, blobs = rank_plan_rows(rp)
        items, file_index, offsets, lengths, blob_index = (tuple(c) for c in rows.T.tolist())
        return cls(
            rp.rank,
            rp.save_id,
            tuple(files),
            items,
            file_index,
            offsets,
            lengths,
            tuple(blobs[b] if b >= 0 else "" for b in blob_index),
        )

    def renamed(self, save_id: str) -> RankSavePlan:
        """The plan under ``save_id``: each file name with its first ``self.save_id`` replaced."""
        names = [f.replace(self.save_id, save_id, 1) for f in self.files]
        files = [names[i] for i in self.file_index]
        return RankSavePlan(
            self.rank, save_id, tuple(map(WriteEntry, self.items, files, self.offsets, self.lengths, self.blobs))
        )


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """A plan kept for reuse while this rank's local plan stays the same: this rank's own part
    (``mine``) on every rank, and the global plan on the coordinator only (``coordinator``,
    rank 0, which builds the metadata from it at the commit).

    Reuse renames the files under the save id rank 0 drew for this save (``<base>-<seq>-<token>``:
    the ``base`` shows which plan was reused, the random token makes every id unpredictable).
    ``next`` renames ``mine`` only: one new name per file and one entry record per entry of this
    rank, whatever the world size; the coordinator's global plan is renamed when the commit asks
    for it (``global_plan``, on the background thread), never in the blocking part of a save.
    ``columns``: the entries of ``mine`` and of the coordinator's rank plans under ``base``
    (``_Columns``), what the renames start from."""

    local: LocalSavePlan
    mine: RankSavePlan
    coordinator: GlobalSavePlan | None
    base: str
    chunk: int  # the checksum chunk every rank writes with (the coordinator's choice: plan_stage)
    seq: int = 0
    columns: tuple[_Columns, tuple[_Columns, ...]] | None = field(default=None, compare=False, repr=False)

    def next(self, token: str) -> CachedPlan:
        seq = self.seq + 1
        save_id = f"{self.base}-{seq:06d}-{token}"
        columns = self._columns()
        return CachedPlan(
            self.local, columns[0].renamed(save_id), self.coordinator, self.base, self.chunk, seq, columns
        )

    def _columns(self) -> tuple[_Columns, tuple[_Columns, ...]]:
        if self.columns is not None:
            return self.columns
        mine = _Columns.of(self.mine)
        if self.coordinator is None or not isinstance(self.coordinator.rank_plans, tuple):
            return mine, ()  # (a regular plan renames without its entries: global_plan)
        by_rank = tuple(mine if rp is self.mine else _Columns.of(rp) for rp in self.coordinator.rank_plans)
        return mine, by_rank

    @property
    def save_id(self) -> str:
        return self.mine.save_id

    def global_plan(self) -> GlobalSavePlan:
        """The coordinator's global plan under this save's id (rank 0 only)."""
        if self.coordinator is None:
            raise InternalError("only the coordinator (rank 0) holds the global save plan")
        if self.coordinator.save_id == self.save_id:
            return self.coordinator
        gplan, save_id = self.coordinator, self.save_id
        files = tuple(f.replace(gplan.save_id, save_id, 1) for f in gplan.files)
        if isinstance(gplan.rank_plans, RegularRankPlans):  # entries computed when asked: rename only
            return replace(gplan, save_id=save_id, rank_plans=gplan.rank_plans.renamed(save_id), files=files)
        mine = self.mine  # already renamed (next): this rank's part of the global plan
        rank_plans = tuple(mine if c.rank == mine.rank else c.renamed(save_id) for c in self._columns()[1])
        return replace(gplan, save_id=save_id, rank_plans=rank_plans, files=files)


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
    # own part of the global plan (planning.plan_codec; O(its entries), not O(the job)); the
    # coordinator plans on templates of ranks (planning.regular_plan) or on columns
    # (planning.shard_table) and keeps its own part as it is
    if coord.world_size == 1:
        gplan = plan_save([local], save_id, files_per_rank)
        return CachedPlan(local, gplan.rank_plans[0], gplan, save_id, checksum_chunk_of(gplan, checksum_chunk))
    encoded = coord.gather_object(encode_local_plan(local))
    parts: list[object] | None = None
    coordinator: GlobalSavePlan | None = None
    if coord.rank == 0:
        assert encoded is not None
        try:
            # bytes as gathered: a regular job is planned reading them one rank at a time
            coordinator = plan_save(encoded, save_id, files_per_rank)  # type: ignore[arg-type]
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
