"""The save planner's reference oracle: the plain per-record statement of its rules.

``plan_records`` plans a job one Python record per shard and rank, each rule in its plainest
form; ``plan_reference`` adds ``regularize``'s split layouts (below), which is what
``unickpt.planning.save.plan_save`` must return (entry for entry) on every job, or the same
error. This was the library's own fallback planner; the library now plans every job on rank
groups (``planning.save.plan``) and the tests hold this one as the statement that is checked
against (tests/unit/planning/save/test_plan_properties.py, test_plan.py).

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

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

# What the oracle takes from unickpt: the plan's record types and errors (so plans and refusals
# compare equal), the dtype size table, and the wording of the two refusals it words the same
# way (format.validation). Every planning rule (writer choice, replicas, layout, alignment,
# torch.chunk rows, the split layouts) is stated below on its own.
from unickpt.errors import CheckpointError, PlanningError
from unickpt.format.dtypes import itemsize
from unickpt.format.validation import box_coverage_problem, overlap_problems
from unickpt.planning.save.model import GlobalSavePlan, LocalSavePlan, RankSavePlan, WriteEntry, file_name
from unickpt.planning.specs import Shape

ALIGN = 64  # every entry of a data file starts at a multiple of 64 bytes


def numel(shape) -> int:
    return math.prod(shape)


def padded(nbytes):
    """``nbytes`` rounded up to the next multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def chunk_rows(n: int, parts: int, p: int) -> tuple[int, int]:
    """(first row, rows) of ``torch.chunk``'s part ``p`` of ``n`` rows into ``parts`` (chunks of
    ceil(n / parts) rows; the last ones short or empty)."""
    c = -(-n // parts) if parts else 0
    lo = min(n, p * c)
    return lo, min(n, lo + c) - lo


def lightest_rank(ranks, load) -> int:
    """The rank among ``ranks`` with the fewest bytes so far, the lowest on a tie."""
    return min(ranks, key=lambda r: (load[r], r))


def named_source(sources, holds) -> int | None:
    """The lowest named source (-1: none) that holds the box, or None to balance."""
    named = sorted(set(sources) - {-1})
    return next((s for s in named if holds(s)), None)


def _lightest_parts(sizes: list[int], loads: list[int]) -> list[int]:
    """Each item, in this order, to the part with the fewest bytes so far (lowest on a tie)."""
    loads = list(loads)
    out = []
    for size in sizes:
        k = min(range(len(loads)), key=lambda j: (loads[j], j))
        loads[k] += size
        out.append(k)
    return out


def largest_first(sizes: list[int], parts: int) -> list[int]:
    """The part of each item when items go largest first (ties in their order) to the lightest."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    out = [0] * len(sizes)
    for i, k in zip(order, _lightest_parts([sizes[i] for i in order], [0] * parts)):
        out[i] = k
    return out


def place(sizes: list[int], loads: list[int], ends: list[int]) -> list[tuple[int, int]]:
    """(part, byte offset) of each item in this order: to the lightest part from ``loads``, at
    that part's next aligned end."""
    ends = list(ends)
    out = []
    for size, k in zip(sizes, _lightest_parts(sizes, loads)):
        out.append((k, ends[k]))
        ends[k] += padded(size)
    return out


__all__ = [
    "plan_records",
    "plan_reference",
    "regularize",
    "split_tensors",
    "layout",
    "plan_problems",
    "rank_loads",
    "outcome",
    "assert_same_plan",
]


def plan_reference(local_plans: list[LocalSavePlan], save_id: str, files_per_rank: int) -> GlobalSavePlan:
    """What ``plan_save`` returns: ``plan_records``' plan with its split tensors laid out alike
    in every rank's files (``regularize``)."""
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


def assert_same_plan(a: GlobalSavePlan, b: GlobalSavePlan) -> None:
    """Assert ``a`` and ``b`` are the same plan, field by field (so a failure names the field),
    tensors in the same order too, rank plans lazy or a tuple alike."""
    assert a.save_id == b.save_id
    assert a.tensors == b.tensors and list(a.tensors.items()) == list(b.tensors.items())
    assert a.files == b.files
    assert a.layouts == b.layouts
    assert a.writers == b.writers
    assert list(a.rank_plans) == list(b.rank_plans)
    assert a == b


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


# Split tensors: the plain statement, on records, of the rule ``planning.save.split`` applies on
# rank groups


def split_tensors(gplan: GlobalSavePlan) -> dict[str, int]:
    """The tensors of ``gplan`` whose ``torch.chunk`` parts over the ranks are written by their
    ranks, rank r chunk r, each non-empty chunk once (empty ones by nobody): fqn -> the dimension
    they are split along (in the plan's tensor order)."""
    world = len(gplan.rank_plans)
    boxes: dict[str, list[tuple[Shape, Shape, int]]] = defaultdict(list)
    for fqn, offs, lens, rank, _ in gplan.writers:
        boxes[fqn].append((offs, lens, rank))
    out = {}
    chunks: dict[tuple[Shape, int], list[tuple[Shape, Shape, int]]] = {}
    for fqn, (_, shape) in gplan.tensors.items():
        found = boxes.get(fqn, [])
        if not shape or math.prod(shape) == 0 or not found:
            continue
        offs, lens, _ = found[0]
        cut = [i for i, (o, n, s) in enumerate(zip(offs, lens, shape)) if o != 0 or n != s]
        d = cut[0] if len(cut) == 1 else -1
        if d < 0:
            continue
        want = chunks.get((shape, d))
        if want is None:  # many tensors share a shape: their chunk boxes are built once
            want = chunks[(shape, d)] = _chunk_boxes(shape, d, world)
        # one box per non-empty chunk, rank r's chunk r (compared as whole lists: C speed)
        if len(found) == len(want) and (found == want or sorted(found, key=_by_rank) == want):
            out[fqn] = d
    return out


def _chunk_boxes(shape: Shape, d: int, world: int) -> list[tuple[Shape, Shape, int]]:
    """``(offsets, lengths, rank)`` of every non-empty ``torch.chunk`` part of ``shape`` along
    ``d`` over ``world`` ranks, rank order."""
    out = []
    for r in range(world):
        lo, n = chunk_rows(shape[d], world, r)
        if not n:
            break
        offs, lens = [0] * len(shape), list(shape)
        offs[d], lens[d] = lo, n
        out.append((tuple(offs), tuple(lens), r))
    return out


def _by_rank(box: tuple[Shape, Shape, int]) -> int:
    return box[2]


def _full(gplan: GlobalSavePlan, split: dict[str, int]) -> dict[str, int]:
    """The split tensors whose every chunk has rows."""
    world = len(gplan.rank_plans)
    return {f: d for f, d in split.items() if chunk_rows(gplan.tensors[f][1][d], world, world - 1)[1]}


def regularize(gplan: GlobalSavePlan, files_per_rank: int) -> GlobalSavePlan:
    """``gplan`` with its split tensors laid out alike in every rank's files (module docstring)
    and those layouts recorded; ``gplan`` itself when it has none (one rank, or no split
    tensor)."""
    world = len(gplan.rank_plans)
    split = split_tensors(gplan) if world > 1 else {}
    if not split:
        return gplan
    try:
        out = _laid_out(gplan, split, files_per_rank)
    except _RankWithoutFile:  # keep the tensors with empty chunks as rows
        split = _full(gplan, split)
        try:
            out = _laid_out(gplan, split, files_per_rank) if split else gplan
        except _RankWithoutFile:
            out = gplan
    if out is not gplan:
        _check(out)
    return out


class _RankWithoutFile(Exception):
    """A layout part would name a file its rank does not write (the rank holds only empty
    chunks of that part's tensors and nothing else there): ``regularize`` then lays out fewer
    tensors, or none."""


def _laid_out(gplan: GlobalSavePlan, split: dict[str, int], files_per_rank: int) -> GlobalSavePlan:
    world = len(gplan.rank_plans)
    parts = max(1, files_per_rank)
    part_of = _parts(gplan, split, parts, world)
    item_of = {(rank, fqn): idx for fqn, _, _, rank, idx in gplan.writers if fqn in split}
    order = [fqn for fqn in gplan.tensors if fqn in split]  # the job's tensor order
    per_part = [[fqn for fqn in order if part_of[fqn] == k] for k in range(parts)]
    rank_plans = []
    files: list[str] = []
    for rp in gplan.rank_plans:
        entries = _rank_layout(gplan, rp, per_part, item_of, split, parts)
        rank_plans.append(RankSavePlan(rp.rank, gplan.save_id, entries))
        files.extend(dict.fromkeys(e.file for e in entries))
    index = {f: i for i, f in enumerate(files)}
    used = [k for k in range(parts) if per_part[k]]
    if any(file_name(r, k) not in index for r in range(world) for k in used):
        raise _RankWithoutFile
    layouts = tuple(
        (
            tuple(index[file_name(r, k)] for r in range(world)),
            tuple((fqn, split[fqn]) for fqn in per_part[k]),
        )
        for k in range(parts)
        if per_part[k]
    )
    writers = tuple(w for w in gplan.writers if w[0] not in split)  # the layouts describe the rest
    return replace(gplan, rank_plans=tuple(rank_plans), files=tuple(files), writers=writers, layouts=layouts)


def _parts(gplan: GlobalSavePlan, split: dict[str, int], parts: int, world: int) -> dict[str, int]:
    """Each split tensor's part (file) on every rank: largest chunk first to the part with the
    fewest bytes, by the sizes of chunk 0 (the same decision on every rank)."""
    size = {}
    for fqn, d in split.items():
        dtype, shape = gplan.tensors[fqn]
        size[fqn] = chunk_rows(shape[d], world, 0)[1] * (math.prod(shape) // shape[d]) * itemsize(dtype)
    return dict(zip(split, largest_first([size[f] for f in split], parts)))  # ties: the tensor order


def _rank_layout(
    gplan: GlobalSavePlan,
    rp: RankSavePlan,
    per_part: list[list[str]],
    item_of: dict[tuple[int, str], int],
    split: dict[str, int],
    parts: int,
) -> tuple[WriteEntry, ...]:
    """One rank's entries: its chunk of each split tensor first in each part, in order, then
    its other entries, largest first to the lightest part."""
    sizes = {e.item_index: e.byte_length for e in rp.entries if not e.blob_key}
    placed: list[list[WriteEntry]] = [[] for _ in range(parts)]
    ends = [0] * parts  # where each part's next entry starts (aligned)
    loads = [0] * parts  # the bytes each part holds (what the lightest part is chosen by)
    mine = set()
    for k, names in enumerate(per_part):
        name = file_name(rp.rank, k)
        for fqn in names:
            idx = item_of.get((rp.rank, fqn))
            if idx is None:  # an empty chunk: no bytes here (its layout part is empty too)
                continue
            mine.add(idx)
            placed[k].append(WriteEntry(idx, name, ends[k], sizes[idx]))
            ends[k] += padded(sizes[idx])
            loads[k] += sizes[idx]
    rest = sorted((e for e in rp.entries if e.blob_key or e.item_index not in mine), key=_rest_order)
    for e, (k, off) in zip(rest, place([e.byte_length for e in rest], loads, ends)):
        placed[k].append(WriteEntry(e.item_index, file_name(rp.rank, k), off, e.byte_length, e.blob_key))
    return tuple(e for k in range(parts) for e in placed[k])


def _rest_order(e: WriteEntry) -> tuple[int, bool, int, str]:
    """Largest first; among equal sizes tensors by item, then blobs by key (what
    ``planning.save.plan`` places alike without the entries' earlier order)."""
    return -e.byte_length, bool(e.blob_key), e.item_index if not e.blob_key else 0, e.blob_key


def _check(gplan: GlobalSavePlan) -> None:
    """No two entries of a file overlap (the decoder's check, before anything is written)."""
    index = {f: i for i, f in enumerate(gplan.files)}
    rows = [(index[e.file], e.byte_offset, e.byte_length) for rp in gplan.rank_plans for e in rp.entries]
    if not rows:
        return
    a = np.array(rows, dtype=np.int64)
    problems = overlap_problems(gplan.files, ["entry"], np.zeros(len(a), dtype=np.int64), a[:, 0], a[:, 1], a[:, 2])
    if len(index) != len(gplan.files) or problems:
        raise PlanningError("the regular layout of the save plan is inconsistent:\n  " + "\n  ".join(problems[:20]))
