"""Save planning: local plans from every rank -> one global plan (pure functions).

Called by the coordinator (rank 0) inside ``engine.plan_cache.plan_stage`` after ``all_gather``/``gather`` of the
ranks' ``LocalSavePlan``s; the result is scattered back as ``RankSavePlan``s and reused (cached)
while the local plans do not change. Steps:
1. check every rank agrees on each tensor's dtype and global shape;
2. deduplicate: identical boxes on several ranks are replicas; each is written once: by the
   replica a holder's spec names as ``replica_source`` (the copy the framework treats as
   authoritative, e.g. DDP buffers: rank 0 of the DDP group), else by the replica with the
   fewest bytes assigned so far (worst-fit, largest boxes first);
3. check the written boxes of each tensor neither overlap nor leave gaps
   (``format.validation.box_coverage_problem``, the same check the metadata decoder runs);
4. lay out bytes: each rank's items go into ``files_per_rank`` files, balanced by bytes, each
   entry starting at a multiple of ENTRY_ALIGN bytes; self-check that no two entries of a file
   overlap (``format.validation.overlap_problems``, again the decoder's check), so a plan that
   passes here decodes;
5. ``planning.regular.regularize``: tensors every rank holds one chunk of (FSDP over the whole
   job) are laid out alike in every rank's files and recorded as layouts, so the metadata
   describes each once.
The coordinator receives the local plans as ``ShardTable``s (``plan_codec.decode_local_table``:
columns, no record per remote shard) and ``plan_save`` runs these steps on columns
(``table_plan.plan_tables``); the record planner here (``_plan_records``) plans what the
columns leave (see ``plan_save``) and is the reference the column planner is tested against.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PlanningError
from ..format.dtypes import itemsize
from ..format.validation import box_coverage_problem, overlap_problems
from .boxes import numel
from .shard_table import ShardTable
from .specs import BlobSpec, Shape, ShardSpec

if TYPE_CHECKING:
    from .regular_plan import RegularRankPlans

__all__ = ["LocalSavePlan", "WriteEntry", "RankSavePlan", "GlobalSavePlan", "plan_save", "data_file_name"]


@dataclass(frozen=True, slots=True)
class LocalSavePlan:
    rank: int
    shards: tuple[ShardSpec, ...]
    blobs: tuple[BlobSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class WriteEntry:
    """Write local item ``item_index`` (or blob when ``blob_key`` is set) at ``byte_offset`` of ``file``."""

    item_index: int
    file: str
    byte_offset: int
    byte_length: int
    blob_key: str = ""


@dataclass(frozen=True, slots=True)
class RankSavePlan:
    rank: int
    save_id: str
    entries: tuple[WriteEntry, ...]  # grouped by file, in byte order

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.file for e in self.entries))

    @property
    def nbytes(self) -> int:
        return sum(e.byte_length for e in self.entries)


@dataclass(frozen=True, slots=True)
class GlobalSavePlan:
    save_id: str
    # every rank's part: a tuple, or (regular jobs: planning.regular_plan) computed when asked
    rank_plans: tuple[RankSavePlan, ...] | RegularRankPlans
    files: tuple[str, ...]
    tensors: dict[str, tuple[str, Shape]]  # fqn -> (dtype, global shape)
    # (fqn, offsets, lengths, rank, item_index): which rank writes each kept box outside the layouts
    writers: tuple[tuple[str, Shape, Shape, int, int], ...]
    # regular layouts (planning.regular): per layout, the index in ``files`` of each part's file
    # (part r: rank r's) and its tensors in byte order with the dimension they are split along
    layouts: tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...] = ()

    def rank_rows(self, rank: int) -> tuple[list[str], np.ndarray, list[str]]:
        """Rank ``rank``'s part as columns (what ``plan_codec.encode_rank_rows`` sends): its
        files, one row per entry (item index, file index, byte offset, byte length, blob index
        or -1), its blob keys."""
        if not isinstance(self.rank_plans, tuple):
            return self.rank_plans.rank_rows(rank)
        return rank_plan_rows(self.rank_plans[rank])

    def explicit_entries(self) -> Iterator[tuple[int, WriteEntry]]:
        """(rank, entry) of at least every entry outside the layouts (the metadata's rows and
        blobs; a tuple of rank plans lists all its entries)."""
        if not isinstance(self.rank_plans, tuple):
            return self.rank_plans.explicit_entries()
        return ((rp.rank, e) for rp in self.rank_plans for e in rp.entries)

    def file_ends(self) -> dict[str, tuple[int, int]]:
        """Every data file's planned size and the rank writing it."""
        if not isinstance(self.rank_plans, tuple):
            return self.rank_plans.file_ends()
        want: dict[str, tuple[int, int]] = {}
        for rp in self.rank_plans:
            for e in rp.entries:
                want[e.file] = (max(want.get(e.file, (0, 0))[0], e.byte_offset + e.byte_length), rp.rank)
        return want


def rank_plan_rows(plan: RankSavePlan) -> tuple[list[str], np.ndarray, list[str]]:
    """``GlobalSavePlan.rank_rows`` of one ``RankSavePlan``."""
    files: dict[str, int] = {}
    blobs: dict[str, int] = {}
    entries = plan.entries
    rows = np.empty((len(entries), 5), dtype=np.int64)
    rows[:, 0] = [e.item_index for e in entries]
    rows[:, 1] = [files.setdefault(e.file, len(files)) for e in entries]
    rows[:, 2] = [e.byte_offset for e in entries]
    rows[:, 3] = [e.byte_length for e in entries]
    rows[:, 4] = [blobs.setdefault(e.blob_key, len(blobs)) if e.blob_key else -1 for e in entries]
    return list(files), rows, list(blobs)


# every entry starts at a multiple of this (element-aligned views, cache-line aligned copies)
ENTRY_ALIGN = 64


def data_file_name(save_id: str, rank: int, part: int) -> str:
    return f"data/{save_id}/r{rank:05d}-{part:02d}.bin"


def plan_save(
    local_plans: Sequence[LocalSavePlan | ShardTable | bytes], save_id: str, files_per_rank: int = 1
) -> GlobalSavePlan:
    """The global plan of every rank's local plan (records, tables, or the bytes ranks send:
    ``plan_codec.encode_local_plan``). Regular jobs are planned on templates of ranks
    (``regular_plan.plan_regular``, which decodes bytes one rank at a time). Other jobs whose
    every step is the common case (tensors agree across ranks, no rank holding one box twice,
    sizes far from int64's limits) are planned on columns (``table_plan.plan_tables``);
    anything else, and every refusal, by the record planner (``_plan_records``), whose plan
    the columns' equals (property-tested)."""
    world = len(local_plans)
    if files_per_rank < 1:
        raise PlanningError("files_per_rank must be >= 1")
    from .plan_codec import decode_local_table
    from .regular import regularize  # split tensors laid out alike in every rank's files
    from .regular_plan import plan_regular  # regular jobs: no record per rank and entry
    from .table_plan import plan_tables  # the column planner (it builds this module's records)

    regular = plan_regular(local_plans, save_id, files_per_rank)
    if regular is not None:
        return regular
    tables = [
        p if isinstance(p, ShardTable) else decode_local_table(p) if isinstance(p, bytes) else ShardTable.of(p)
        for p in local_plans
    ]
    if [t.rank for t in tables] != list(range(world)):
        raise PlanningError("local plans must come from ranks 0..world_size-1 in order")
    fast = plan_tables(tables, save_id, files_per_rank)
    if fast is not None:
        return regularize(fast, files_per_rank)
    records = [p if isinstance(p, LocalSavePlan) else t.to_plan() for p, t in zip(local_plans, tables)]
    return regularize(_plan_records(records, save_id, files_per_rank), files_per_rank)


def _plan_records(local_plans: list[LocalSavePlan], save_id: str, files_per_rank: int) -> GlobalSavePlan:
    """The record planner: the reference, and the planner of every case ``_plan_tables``
    leaves (see the module docstring for the steps)."""
    world = len(local_plans)
    tensors: dict[str, tuple[str, Shape]] = {}
    holders: dict[tuple[str, Shape, Shape], list[tuple[int, int]]] = defaultdict(list)
    problems: list[str] = []
    for plan in local_plans:
        for idx, s in enumerate(plan.shards):
            seen = tensors.setdefault(s.fqn, (s.dtype, s.global_shape))
            if seen != (s.dtype, s.global_shape):
                problems.append(
                    f"{s.fqn}: rank {plan.rank} has dtype {s.dtype} shape {s.global_shape}, "
                    f"another rank has dtype {seen[0]} shape {seen[1]}"
                )
                continue
            if s.numel == 0 and s.global_shape and numel(s.global_shape) != 0:
                continue  # empty shard (uneven sharding): nothing to write
            holders[(s.fqn, s.offsets, s.lengths)].append((plan.rank, idx))
    if problems:
        raise PlanningError("ranks disagree on tensor metadata:\n  " + "\n  ".join(problems[:20]))

    # worst-fit: unique boxes are fixed; replicated ones go, largest first, to the lightest replica
    load = [0] * world
    chosen: dict[tuple[str, Shape, Shape], tuple[int, int]] = {}
    replicated = []
    for key, hs in holders.items():
        nbytes = numel(key[2]) * itemsize(tensors[key[0]][0])
        fixed = hs[0] if len(hs) == 1 else _preferred_source(local_plans, hs)
        if fixed is not None:
            chosen[key] = fixed
            load[fixed[0]] += nbytes
        else:
            replicated.append((nbytes, key))
    replicated.sort(key=lambda t: (-t[0], t[1]))
    for nbytes, key in replicated:
        rank, idx = min(holders[key], key=lambda h: (load[h[0]], h[0]))
        chosen[key] = (rank, idx)
        load[rank] += nbytes

    by_fqn: dict[str, list[tuple[Shape, Shape]]] = defaultdict(list)
    for fqn, offs, lens in chosen:
        by_fqn[fqn].append((offs, lens))
    for fqn, (_dtype, shape) in tensors.items():
        boxes = by_fqn.get(fqn, [])
        if numel(shape) == 0:
            continue
        problem = box_coverage_problem(shape, boxes)
        if problem is not None:
            problems.append(f"{fqn}: {problem}")
    if problems:
        raise PlanningError("the ranks' shards do not tile their tensors:\n  " + "\n  ".join(problems[:20]))

    per_rank: list[list[tuple[int, int, str]]] = [[] for _ in range(world)]  # (nbytes, item, blob)
    writers = []
    for (fqn, offs, lens), (rank, idx) in sorted(chosen.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        per_rank[rank].append((numel(lens) * itemsize(tensors[fqn][0]), idx, ""))
        writers.append((fqn, offs, lens, rank, idx))
    for plan in local_plans:
        for blob in plan.blobs:
            per_rank[plan.rank].append((blob.nbytes, -1, blob.key))

    rank_plans = []
    all_files: list[str] = []
    for rank, work in enumerate(per_rank):
        entries = _layout(save_id, rank, work, files_per_rank)
        rank_plans.append(RankSavePlan(rank, save_id, entries))
        all_files.extend(f for f in dict.fromkeys(e.file for e in entries))
    _check_layout(local_plans, rank_plans, all_files)
    return GlobalSavePlan(save_id, tuple(rank_plans), tuple(all_files), tensors, tuple(writers))


def _check_layout(local_plans: list[LocalSavePlan], rank_plans: list[RankSavePlan], files: list[str]) -> None:
    """Self-check of the byte layout: every file named once, no two entries of a file overlap."""
    index = {f: i for i, f in enumerate(files)}
    owners: list[str] = []
    who, fidx, boff, blen = [], [], [], []
    for rp in rank_plans:
        shards = local_plans[rp.rank].shards
        for e in rp.entries:
            who.append(len(owners))
            owners.append(e.blob_key or shards[e.item_index].fqn)
            fidx.append(index[e.file])
            boff.append(e.byte_offset)
            blen.append(e.byte_length)
    arrays = [np.array(a, dtype=np.int64) for a in (who, fidx, boff, blen)]
    problems = overlap_problems(files, owners, *arrays)
    if len(index) != len(files):
        problems.insert(0, "two ranks were given the same data file")
    if problems:
        raise PlanningError("the save plan's byte layout is inconsistent:\n  " + "\n  ".join(problems[:20]))


def _preferred_source(local_plans: list[LocalSavePlan], holders: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The holder a spec names as ``replica_source`` (the lowest such rank among the holders when
    replica groups name different sources), or None to balance."""
    ranks = {rank: idx for rank, idx in holders}
    named = {local_plans[r].shards[i].replica_source for r, i in holders} - {None}
    for src in sorted(s for s in named if s is not None):
        if src in ranks:
            return src, ranks[src]
    return None


def _layout(save_id: str, rank: int, work: list[tuple[int, int, str]], parts: int) -> tuple[WriteEntry, ...]:
    """Spread one rank's items over ``parts`` files (largest first to the lightest file)."""
    if not work:
        return ()
    parts = min(parts, len(work))
    heap = [(0, p) for p in range(parts)]
    assigned: list[list[tuple[int, int, str]]] = [[] for _ in range(parts)]
    order = sorted(range(len(work)), key=lambda i: -work[i][0]) if parts > 1 else range(len(work))
    for i in order:
        size, part = heapq.heappop(heap)
        assigned[part].append(work[i])
        heapq.heappush(heap, (size + work[i][0], part))
    entries = []
    for part, items in enumerate(assigned):
        name = data_file_name(save_id, rank, part)
        offset = 0
        for nbytes, idx, blob in items:
            entries.append(WriteEntry(idx, name, offset, nbytes, blob))
            offset += -(-nbytes // ENTRY_ALIGN) * ENTRY_ALIGN
    return tuple(entries)
