"""Save planning: local plans from every rank -> one global plan (pure functions).

Runs on the coordinator (rank 0) in the plan stage (``engine.plan_cache``), after the gather of
the ranks' ``LocalSavePlan``s; the result is scattered back as ``RankSavePlan``s and reused (cached)
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
5. ``regular.regularize``: tensors every rank holds one chunk of (FSDP over the whole
   job) are laid out alike in every rank's files and recorded as layouts, so the metadata
   describes each once.
``plan_save`` takes the ranks' ``ShardTable``s (the coordinator decodes them as the planner
asks: ``wire.LocalPlans``) and runs these steps on templates of ranks (``templates``) or on
columns (``columns``), with the rules of ``writers`` (step 2) and ``layout`` (step 4) written
once; the record planner here (``_plan_records``) plans what those leave (see ``plan_save``)
and is the reference both are tested against.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from ...errors import PlanningError
from ...format.dtypes import itemsize
from ...format.validation import box_coverage_problem, overlap_problems
from ..boxes import numel
from ..specs import Shape
from .columns import plan_tables
from .layout import place
from .model import GlobalSavePlan, LocalSavePlan, RankSavePlan, WriteEntry, file_name
from .regular import regularize
from .table import ShardTable
from .templates import plan_regular
from .writers import lightest_rank, named_source

__all__ = ["plan_save"]


def plan_save(
    local_plans: Sequence[LocalSavePlan | ShardTable], save_id: str, files_per_rank: int = 1
) -> GlobalSavePlan:
    """The global plan of every rank's local plan (records or tables: the coordinator passes
    ``wire.LocalPlans``, which decodes the gathered bytes when a table is asked for). Regular
    jobs are planned on templates of ranks (``templates.plan_regular``, which reads one rank's
    table at a time). Other jobs whose every step is the common case (tensors agree across
    ranks, no rank holding one box twice, sizes far from int64's limits) are planned on columns
    (``columns.plan_tables``); anything else, and every refusal, by the record planner
    (``_plan_records``), whose plan the columns' equals (property-tested)."""
    world = len(local_plans)
    if files_per_rank < 1:
        raise PlanningError("files_per_rank must be >= 1")
    regular = plan_regular(local_plans, save_id, files_per_rank)
    if regular is not None:
        return regular
    tables = [p if isinstance(p, ShardTable) else ShardTable.of(p) for p in local_plans]
    if [t.rank for t in tables] != list(range(world)):
        raise PlanningError("local plans must come from ranks 0..world_size-1 in order")
    fast = plan_tables(tables, save_id, files_per_rank)
    if fast is not None:
        return regularize(fast, files_per_rank)
    records = [p if isinstance(p, LocalSavePlan) else t.to_plan() for p, t in zip(local_plans, tables)]
    return regularize(_plan_records(records, save_id, files_per_rank), files_per_rank)


def _plan_records(local_plans: list[LocalSavePlan], save_id: str, files_per_rank: int) -> GlobalSavePlan:
    """The record planner: the reference, and the planner of every case ``columns.plan_tables``
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
        hs = holders[key]
        rank = lightest_rank([r for r, _ in hs], load)
        idx = next(i for r, i in hs if r == rank)
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
    ranks = {rank: idx for rank, idx in holders}  # a rank holding the box twice: its last
    sources = (local_plans[r].shards[i].replica_source for r, i in holders)
    src = named_source((-1 if s is None else s for s in sources), ranks.__contains__)
    return None if src is None else (src, ranks[src])


def _layout(save_id: str, rank: int, work: list[tuple[int, int, str]], parts: int) -> tuple[WriteEntry, ...]:
    """Spread one rank's items over ``parts`` files (largest first to the lightest file)."""
    if not work:
        return ()
    parts = min(parts, len(work))
    order = sorted(range(len(work)), key=lambda i: -work[i][0]) if parts > 1 else list(range(len(work)))
    placed = place([work[i][0] for i in order], [0] * parts, [0] * parts)
    by_part = sorted(zip(order, placed), key=lambda t: t[1][0])  # stable: each part's in placement order
    return tuple(WriteEntry(work[i][1], file_name(rank, k), off, work[i][0], work[i][2]) for i, (k, off) in by_part)
