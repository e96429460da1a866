"""The save planner on columns: every rank's ``ShardTable`` -> the global plan, with numpy
instead of one Python record per shard and rank.

``plan.plan_save`` calls it on the coordinator for every job the templates do not fit. Steps:
the ranks' tables as one set of rows (``rows.JobRows``, one group per rank: sizes past int64's
limits refused); tensors checked across ranks (``JobRows.disagreements``: a refusal names every
rank that disagrees); each distinct box written by its only holder, the replica source a holder
names, else worst-fit (``writers.choose_writers``; a rank holding one box twice is one holder of
it); the written boxes tile their tensors (``rows.tiling_problems``); tensors the ranks write as
``torch.chunk`` parts, rank r chunk r, laid out alike in every rank's files and recorded as
layouts (``split``: ``split_dims``, with its retry with fewer split tensors, then none); each
rank's entries laid out in its files by ``layout.lay_out_rank``; the byte layout self-checked
(``format.validation.overlap_problems``: a failure is a bug, ``InternalError``). Every refusal
raises (``PlanningError``; an unknown dtype ``CorruptMetadataError``). Records are built once at
the end, sharing one tuple per distinct box (``rows.tuples``).
Property-tested against the plain per-record planner, ``tests/support/save_oracle.py``:
tests/unit/planning/test_save_planner.py and test_save_oracle.py.
"""

from __future__ import annotations

import numpy as np

from ...errors import InternalError, PlanningError
from ...format.validation import overlap_problems
from .layout import lay_out_rank
from .model import GlobalSavePlan, RankSavePlan, WriteEntry, file_name
from .rows import MAX_BLOB, MAX_TOTAL, JobRows, tiling_problems, tuples
from .split import RankWithoutFile, full_chunks, split_dims, split_parts
from .table import ShardTable
from .writers import choose_writers

__all__ = ["plan_tables"]


def plan_tables(tables: list[ShardTable], save_id: str, files_per_rank: int) -> GlobalSavePlan:
    """The global plan of ``tables`` (rank r's at index r; module docstring); raises
    ``PlanningError`` for a job that cannot be saved (ranks disagreeing on a tensor, boxes that
    do not tile it, absurd sizes)."""
    rows = JobRows.of(tables)
    problems = rows.disagreements()
    if problems:
        raise PlanningError("ranks disagree on tensor metadata:\n  " + "\n  ".join(problems[:20]))
    if float(rows.nbytes[rows.kept].sum(dtype=np.float64)) > MAX_TOTAL:
        raise PlanningError(f"the job's tensors hold more than 2^{MAX_TOTAL.bit_length() - 1} bytes")
    for t in tables:
        for b in t.blobs:
            if not 0 <= b.nbytes <= MAX_BLOB:
                raise PlanningError(f"blob {b.key!r} of rank {t.rank}: {b.nbytes} bytes is outside [0, {MAX_BLOB}]")
    chosen, record_order = _choose_writers(rows, len(tables))
    problems = tiling_problems(rows, chosen, record_order)
    if problems:
        raise PlanningError("the ranks' shards do not tile their tensors:\n  " + "\n  ".join(problems[:20]))
    chosen.sort()  # (rank, index) order: rows are concatenated rank by rank
    world = len(tables)
    dim, chunks = split_dims(
        rows.name[chosen],
        rows.rank[chosen],
        rows.shape[chosen],
        rows.offsets[chosen],
        rows.lengths[chosen],
        len(rows.names),
        world,
    )
    laid = None
    for attempt in (dim, full_chunks(dim, chunks, world)):
        if (attempt >= 0).any():
            try:
                laid = _lay_out(tables, rows, chosen, save_id, files_per_rank, attempt)
                dim = attempt
                break
            except RankWithoutFile:  # keep fewer tensors (then none) as split layouts
                pass
    if laid is None:
        dim = np.full(len(rows.names), -1, dtype=np.int64)
        laid = _lay_out(tables, rows, chosen, save_id, files_per_rank, dim)
    rank_plans, all_files, layouts = laid
    names = rows.names
    listed = chosen[dim[rows.name[chosen]] < 0]  # the layouts describe the split tensors' boxes
    owners = rows.name[listed].tolist()
    offs = tuples(rows.offsets[listed], rows.ndim[listed])
    lens = tuples(rows.lengths[listed], rows.ndim[listed])
    ranks, items = rows.rank[listed].tolist(), rows.index[listed].tolist()
    writers = tuple(zip([names[g] for g in owners], offs, lens, ranks, items))
    return GlobalSavePlan(save_id, tuple(rank_plans), tuple(all_files), rows.tensors(), writers, layouts)


def _lay_out(
    tables: list[ShardTable], rows: JobRows, chosen: np.ndarray, save_id: str, files_per_rank: int, dim: np.ndarray
) -> tuple[list[RankSavePlan], list[str], tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...]]:
    """Every rank's entries (its chosen boxes in (rank, index) order, then its blobs) in its
    files: with split tensors (``dim``: per tensor id, the dimension it is split along, or -1)
    by ``layout.lay_out_rank``; self-checked. Returns the rank plans,
    the data files and the split layouts (per used part: each rank's file index of that part,
    the part's (fqn, dim) in the tensor order). ``RankWithoutFile`` where a rank would lack a
    file a layout names."""
    world = len(tables)
    names = rows.names
    items = rows.index[chosen].tolist()
    sizes = rows.nbytes[chosen]
    firsts = np.unique(rows.first)
    pos = np.zeros(len(names), dtype=np.int64)
    pos[rows.name[firsts]] = np.arange(len(firsts))  # each tensor's place in the job's tensor order
    split = [g for g in rows.name[firsts].tolist() if dim[g] >= 0]
    part_by_name = np.full(len(names), -1, dtype=np.int64)
    if split:
        rank0 = chosen[(rows.rank[chosen] == 0) & (dim[rows.name[chosen]] >= 0)]
        chunk0 = dict(zip(rows.name[rank0].tolist(), rows.nbytes[rank0].tolist()))
        for g, k in split_parts(split, [chunk0[g] for g in split], files_per_rank).items():
            part_by_name[g] = k
    per_part = [[g for g in split if part_by_name[g] == k] for k in range(files_per_rank)]
    rank_plans: list[RankSavePlan] = []
    all_files: list[str] = []
    columns: list[tuple[np.ndarray, ...]] = []  # per entry: owner, file index, byte offset, byte length
    blob_owner = len(names)  # owner ids of blobs follow the tensors'
    bounds = np.searchsorted(rows.rank[chosen], np.arange(world + 1))
    for t in tables:
        lo, hi = int(bounds[t.rank]), int(bounds[t.rank + 1])
        work_sizes = np.concatenate([sizes[lo:hi], np.array([b.nbytes for b in t.blobs], dtype=np.int64)])
        work_items = items[lo:hi] + [-1] * len(t.blobs)
        work_keys = [""] * (hi - lo) + [b.key for b in t.blobs]
        work_owners = np.concatenate([rows.name[chosen[lo:hi]], blob_owner + np.arange(len(t.blobs), dtype=np.int64)])
        blob_owner += len(t.blobs)
        if split:
            tensor_ids = work_owners.copy()
            tensor_ids[hi - lo :] = 0
            part_of = np.where(np.arange(len(work_sizes)) < hi - lo, part_by_name[tensor_ids], -1)
            tie = np.arange(len(work_sizes), dtype=np.int64)  # boxes by item, then blobs by key
            keys = work_keys[hi - lo :]
            tie[[hi - lo + i for i in sorted(range(len(keys)), key=keys.__getitem__)]] = tie[hi - lo :].copy()
            order, part, offset = lay_out_rank(work_sizes, files_per_rank, tie, part_of, pos[tensor_ids])
        else:
            order, part, offset = lay_out_rank(work_sizes, files_per_rank)
        order_of = order.tolist()
        used = np.unique(part).tolist()  # parts in order (a part that got no entry has no file)
        if split and any(per_part[k] and k not in used for k in range(files_per_rank)):
            raise RankWithoutFile
        files = [file_name(t.rank, p) for p in used]
        local = np.searchsorted(np.array(used, dtype=np.int64), part)
        entry_sizes = work_sizes[order]
        entries = tuple(
            map(
                WriteEntry,
                [work_items[i] for i in order_of],
                [files[k] for k in local.tolist()],
                offset.tolist(),
                entry_sizes.tolist(),
                [work_keys[i] for i in order_of],
            )
        )
        rank_plans.append(RankSavePlan(t.rank, save_id, entries))
        columns.append((work_owners[order], local + len(all_files), offset, entry_sizes))
        all_files.extend(files)
    blobs = [b.key for t in tables for b in t.blobs]
    _check_columns(all_files, columns, [*names, *blobs])
    index = {f: i for i, f in enumerate(all_files)}
    layouts = tuple(
        (
            tuple(index[file_name(r, k)] for r in range(world)),
            tuple((names[g], int(dim[g])) for g in per_part[k]),
        )
        for k in range(files_per_rank)
        if per_part[k]
    )
    return rank_plans, all_files, layouts


def _choose_writers(rows: JobRows, world: int) -> tuple[np.ndarray, np.ndarray]:
    """The row that writes each distinct kept box (``writers.choose_writers`` with one group per
    rank), and each chosen box's place in the record order (what a refusal lists boxes in)."""
    kept = np.flatnonzero(rows.kept)
    chosen, _, record_order = choose_writers(
        rows.names,
        rows.name[kept],
        rows.offsets[kept],
        rows.lengths[kept],
        rows.nbytes[kept],
        rows.source[kept],
        rows.rank[kept],
        np.zeros(world, dtype=np.int64),
    )
    later = record_order >= len(kept)  # the balanced boxes: after every row, in turn
    at = kept[np.minimum(record_order, len(kept) - 1)]
    record_order = np.where(later, record_order - len(kept) + len(rows.rank), at)
    return kept[chosen], record_order


def _check_columns(files: list[str], columns: list[tuple[np.ndarray, ...]], owners: list[str]) -> None:
    """Self-check of the byte layout: every file named once, no two entries of a file overlap."""
    if not columns:  # no ranks
        return
    who, fidx, boff, blen = (np.concatenate([c[k] for c in columns]) for k in range(4))
    problems = overlap_problems(files, owners, who, fidx, boff, blen)
    if len(set(files)) != len(files):
        problems.insert(0, "two ranks were given the same data file")
    if problems:  # the layout above puts no two entries of a file together: a bug
        raise InternalError("the save plan's byte layout is inconsistent:\n  " + "\n  ".join(problems[:20]))
