"""The save planner's reference oracle: the plain per-record statement of its rules.

``plan_records`` plans a job one Python record per shard and rank, each rule in its plainest
form; ``plan_reference`` adds ``regular.regularize``'s layouts, which is what
``unickpt.planning.save.plan_save`` must return (entry for entry) on every job, or the same
error. This was the library's own fallback planner; the library now plans every job on
columns or templates (``planning.save``) and the tests hold this one as the statement those
are checked against (tests/unit/planning/test_save_planner.py, test_save_oracle.py).

Steps (the coordinator's, on every rank's ``LocalSavePlan``):
1. every rank agrees on each tensor's dtype and global shape (else ``PlanningError`` listing
   each disagreeing spec);
2. identical boxes on several ranks are replicas, each written once: by the replica a holder's
   spec names as ``replica_source`` (the lowest named holder), else by the replica with the
   fewest bytes assigned so far (worst-fit, largest boxes first, then by (fqn, offsets,
   lengths)); a rank holding one box twice is one holder (its last spec as the named source,
   its first as the balanced choice); empty shards of non-empty tensors are not written;
3. the written boxes of each tensor tile it (``format.validation.box_coverage_problem``);
4. each rank's items (its boxes in spec order, then its blobs) go largest first to the file
   with the fewest bytes, each entry at a multiple of 64 bytes; no two entries of a file
   overlap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from unickpt.errors import CheckpointError, PlanningError
from unickpt.format.dtypes import itemsize
from unickpt.format.validation import box_coverage_problem, overlap_problems
from unickpt.planning.boxes import numel
from unickpt.planning.save.layout import place
from unickpt.planning.save.model import GlobalSavePlan, LocalSavePlan, RankSavePlan, WriteEntry, file_name
from unickpt.planning.save.regular import regularize
from unickpt.planning.save.writers import lightest_rank, named_source
from unickpt.planning.specs import Shape

__all__ = ["plan_records", "plan_reference", "layout", "plan_problems", "rank_loads", "outcome"]


def plan_reference(local_plans: list[LocalSavePlan], save_id: str, files_per_rank: int) -> GlobalSavePlan:
    """What ``plan_save`` returns: ``plan_records``' plan with its split tensors laid out alike
    in every rank's files (``regular.regularize``)."""
    return regularize(plan_records(local_plans, save_id, files_per_rank), files_per_rank)


def plan_records(local_plans: list[LocalSavePlan], save_id: str, files_per_rank: int) -> GlobalSavePlan:
    """The global plan of ``local_plans`` (rank r's at index r), one Python record per shard
    (the module docstring's steps), without ``regularize``'s layouts; raises ``PlanningError``
    for a job that cannot be saved."""
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
        entries = layout(save_id, rank, work, files_per_rank)
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


def layout(save_id: str, rank: int, work: list[tuple[int, int, str]], parts: int) -> tuple[WriteEntry, ...]:
    """Spread one rank's items over ``parts`` files (largest first to the lightest file)."""
    if not work:
        return ()
    parts = min(parts, len(work))
    order = sorted(range(len(work)), key=lambda i: -work[i][0]) if parts > 1 else list(range(len(work)))
    placed = place([work[i][0] for i in order], [0] * parts, [0] * parts)
    by_part = sorted(zip(order, placed), key=lambda t: t[1][0])  # stable: each part's in placement order
    return tuple(WriteEntry(work[i][1], file_name(rank, k), off, work[i][0], work[i][2]) for i, (k, off) in by_part)


def plan_problems(local_plans: list[LocalSavePlan], gplan: GlobalSavePlan, files_per_rank: int) -> list[str]:
    """What is wrong with ``gplan`` as a plan of ``local_plans``, computed from its entries alone
    (none of the planner's own checks): every distinct non-empty box of the job is written by
    exactly one entry (of a rank holding it, its bytes: elements times the dtype's size), every
    rank's blob by one entry of that rank, each entry at a multiple of 64 bytes, no two entries
    of a file overlap, each rank writes only its own files and at most ``files_per_rank`` of them,
    and the plan's files are exactly the files its entries name."""
    problems: list[str] = []
    boxes: dict[tuple, int] = {}
    for p in local_plans:
        for s in p.shards:
            if numel(s.lengths) or not numel(s.global_shape):
                boxes.setdefault((s.fqn, s.offsets, s.lengths), 0)
    ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    named: list[str] = []
    for rank, rp in enumerate(gplan.rank_plans):
        plan = local_plans[rank]
        mine = {f"r{rank:05d}-{k:02d}.bin" for k in range(files_per_rank)}
        files = list(dict.fromkeys(e.file for e in rp.entries))
        named.extend(files)
        if not set(files) <= mine:
            problems.append(f"rank {rank} writes files {sorted(set(files) - mine)} not its own")
        blobs = {b.key: b.nbytes for b in plan.blobs}
        seen_blobs = []
        for e in rp.entries:
            if e.byte_offset % 64:
                problems.append(f"rank {rank}: entry at {e.byte_offset} of {e.file} is not 64-byte aligned")
            ranges[e.file].append((e.byte_offset, e.byte_length))
            if e.blob_key:
                seen_blobs.append(e.blob_key)
                if blobs.get(e.blob_key) != e.byte_length:
                    problems.append(f"rank {rank}: blob {e.blob_key!r} written with {e.byte_length} bytes")
                continue
            s = plan.shards[e.item_index]
            key = (s.fqn, s.offsets, s.lengths)
            if key not in boxes:
                problems.append(f"rank {rank}: entry of an empty shard {key}")
                continue
            boxes[key] += 1
            if e.byte_length != numel(s.lengths) * itemsize(s.dtype):
                problems.append(f"rank {rank}: {key} written with {e.byte_length} bytes")
        if sorted(seen_blobs) != sorted(blobs):
            problems.append(f"rank {rank}: blobs written {sorted(seen_blobs)}, held {sorted(blobs)}")
    problems.extend(f"box {key} written {n} times" for key, n in boxes.items() if n != 1)
    for f, spans in ranges.items():
        spans.sort()
        for (a, n), (b, _) in zip(spans, spans[1:]):
            if a + n > b:
                problems.append(f"{f}: entries at {a} (+{n}) and {b} overlap")
    if sorted(named) != sorted(gplan.files) or len(set(named)) != len(named):
        problems.append(f"plan lists files {sorted(gplan.files)}, its entries name {sorted(named)}")
    return problems


def rank_loads(gplan: GlobalSavePlan) -> list[int]:
    """The bytes each rank writes."""
    return [sum(e.byte_length for e in rp.entries) for rp in gplan.rank_plans]


def outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or ``(error type, message)`` of the ``CheckpointError`` it raises (a plan
    and a refusal compare alike)."""
    try:
        return fn(*args)
    except CheckpointError as e:
        return (type(e), str(e))
