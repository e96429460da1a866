"""The save planner on columns: every rank's ``ShardTable`` -> the global plan, with numpy
instead of one Python record per shard and rank.

``plan.plan_save`` calls it on the coordinator for every job the templates do not fit. Steps:
tensors checked across ranks (``_Rows.disagreements``: a refusal names every rank that
disagrees), boxes deduplicated by one lexsort, each written by its only holder, the replica
source a holder names, else worst-fit (``writers.choose_writers`` with one group per rank; a
rank holding one box twice is one holder of it); the written boxes tile their tensors (``_tiling_problems``:
one-dimension splits on columns, anything else by ``format.validation.box_coverage_problem``);
tensors the ranks write as ``torch.chunk`` parts, rank r chunk r, laid out alike in every rank's
files and recorded as layouts (``split``: ``split_dims``, with its retry with fewer split
tensors, then none); each rank's entries laid out in its files by ``layout.lay_out_rank``
(equal-size runs placed without a loop); the byte layout
self-checked (``format.validation.overlap_problems``: a failure is a bug, ``InternalError``).
Every refusal raises (``PlanningError``; an unknown dtype ``CorruptMetadataError``); sizes near
int64's limits (a tensor of 2^55 elements, a job of 2^61 bytes, a blob of 2^56 bytes: no machine
holds them) are refused, never planned with wrapped integers. Records are built once at the end,
sharing one tuple per distinct box (``_tuples``).
Property-tested against the plain per-record planner, ``tests/support/save_oracle.py``:
tests/unit/planning/test_save_planner.py and test_save_oracle.py.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ...errors import InternalError, PlanningError
from ...format.dtypes import itemsize
from ...format.validation import box_coverage_problem, overlap_problems
from ..specs import Shape
from .layout import lay_out_rank
from .model import GlobalSavePlan, RankSavePlan, WriteEntry, file_name
from .split import RankWithoutFile, full_chunks, split_dims, split_parts
from .table import ShardTable
from .writers import choose_writers

__all__ = ["plan_tables"]


def plan_tables(tables: list[ShardTable], save_id: str, files_per_rank: int) -> GlobalSavePlan:
    """The global plan of ``tables`` (rank r's at index r; module docstring); raises
    ``PlanningError`` for a job that cannot be saved (ranks disagreeing on a tensor, boxes that
    do not tile it, absurd sizes)."""
    rows = _Rows.of(tables)
    problems = rows.disagreements()
    if problems:
        raise PlanningError("ranks disagree on tensor metadata:\n  " + "\n  ".join(problems[:20]))
    if float(rows.nbytes[rows.kept].sum(dtype=np.float64)) > _MAX_TOTAL:
        raise PlanningError(f"the job's tensors hold more than 2^{_MAX_TOTAL.bit_length() - 1} bytes")
    for t in tables:
        for b in t.blobs:
            if not 0 <= b.nbytes <= _MAX_BLOB:
                raise PlanningError(f"blob {b.key!r} of rank {t.rank}: {b.nbytes} bytes is outside [0, {_MAX_BLOB}]")
    chosen, record_order = _choose_writers(rows, len(tables))
    problems = _tiling_problems(rows, chosen, record_order)
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
    offs = _tuples(rows.offsets[listed], rows.ndim[listed])
    lens = _tuples(rows.lengths[listed], rows.ndim[listed])
    ranks, items = rows.rank[listed].tolist(), rows.index[listed].tolist()
    writers = tuple(zip([names[g] for g in owners], offs, lens, ranks, items))
    return GlobalSavePlan(save_id, tuple(rank_plans), tuple(all_files), rows.tensors(), writers, layouts)


def _lay_out(
    tables: list[ShardTable], rows: _Rows, chosen: np.ndarray, save_id: str, files_per_rank: int, dim: np.ndarray
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


_MAX_BLOB = 1 << 56
_MAX_TOTAL = 1 << 61  # byte offsets stay far inside int64
_MAX_NUMEL_LOG2 = 55  # a tensor's elements (times an item size) far inside int64


@dataclass(frozen=True, eq=False)
class _Rows:
    """Every rank's table concatenated (rows in rank order, then spec order), names and dtypes
    as job-wide ids; ``first``: each row's tensor's first row; ``nbytes`` of each box."""

    names: list[str]
    dtypes: list[str]
    rank: np.ndarray
    index: np.ndarray
    name: np.ndarray
    dtype: np.ndarray
    ndim: np.ndarray
    source: np.ndarray
    shape: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    first: np.ndarray
    nbytes: np.ndarray
    kept: np.ndarray  # rows not skipped as empty shards

    @classmethod
    def of(cls, tables: list[ShardTable]) -> _Rows:
        names: dict[str, int] = {}
        dtypes: dict[str, int] = {}
        width = max([1, *(t.shape.shape[1] for t in tables)])  # >= 1: a padded full dim of 1 for 0-d jobs
        cols: dict[str, list[np.ndarray]] = defaultdict(list)
        seen: tuple[str, ...] | None = None
        name_ids = np.zeros(0, dtype=np.int64)
        for t in tables:
            if t.names != seen:  # ranks of one job usually list the same names in the same order
                name_ids = np.array([names.setdefault(x, len(names)) for x in t.names], dtype=np.int64)
                seen = t.names
            dtype_ids = np.array([dtypes.setdefault(x, len(dtypes)) for x in t.dtypes], dtype=np.int64)
            n, w = t.shape.shape
            cols["rank"].append(np.full(n, t.rank, dtype=np.int64))
            cols["index"].append(np.arange(n, dtype=np.int64))
            cols["name"].append(name_ids[t.name] if n else np.zeros(0, dtype=np.int64))
            cols["dtype"].append(dtype_ids[t.dtype] if n else np.zeros(0, dtype=np.int64))
            cols["ndim"].append(t.ndim)
            cols["source"].append(t.source)
            for key, pad, a in (("shape", 1, t.shape), ("offsets", 0, t.offsets), ("lengths", 1, t.lengths)):
                cols[key].append(np.pad(a, ((0, 0), (0, width - w)), constant_values=pad) if w < width else a)
        c = {k: np.concatenate(v) for k, v in cols.items()}
        for k in ("rank", "index", "name", "dtype", "ndim", "source", "shape", "offsets", "lengths"):  # no ranks
            c.setdefault(k, np.zeros((0, width) if k in ("shape", "offsets", "lengths") else 0, dtype=np.int64))
        sizes = np.array([itemsize(d) for d in dtypes], dtype=np.int64)  # CorruptMetadataError: unknown
        huge = np.log2(np.maximum(c["shape"], 1)).sum(axis=1) > _MAX_NUMEL_LOG2
        if huge.any():
            r = int(np.flatnonzero(huge)[0])
            nd = int(c["ndim"][r])
            raise PlanningError(
                f"{list(names)[int(c['name'][r])]}: global shape {tuple(c['shape'][r, :nd].tolist())} has more than "
                f"2^{_MAX_NUMEL_LOG2} elements"
            )
        tensor_numel = np.prod(c["shape"], axis=1)
        box_numel = np.prod(c["lengths"], axis=1)
        _, first, inverse = np.unique(c["name"], return_index=True, return_inverse=True)
        kept = ~((box_numel == 0) & (c["ndim"] > 0) & (tensor_numel != 0))
        return cls(
            list(names),
            list(dtypes),
            **c,
            first=first[inverse.reshape(-1)],
            nbytes=box_numel * sizes[c["dtype"]],
            kept=kept,
        )

    def disagreements(self) -> list[str]:
        """Every row whose dtype or global shape differs from its tensor's first row (rank
        order, then spec order)."""
        f = self.first
        bad = (self.dtype != self.dtype[f]) | (self.ndim != self.ndim[f]) | (self.shape != self.shape[f]).any(axis=1)
        out = []
        for r in np.flatnonzero(bad).tolist():
            g = int(f[r])
            fqn = self.names[int(self.name[r])]
            mine, seen = self.dtypes[int(self.dtype[r])], self.dtypes[int(self.dtype[g])]
            out.append(
                f"{fqn}: rank {int(self.rank[r])} has dtype {mine} shape {self._shape(r)}, "
                f"another rank has dtype {seen} shape {self._shape(g)}"
            )
        return out

    def _shape(self, r: int) -> Shape:
        return tuple(self.shape[r, : int(self.ndim[r])].tolist())

    def box(self, r: int) -> tuple[str, Shape, Shape]:
        nd = int(self.ndim[r])
        return (
            self.names[int(self.name[r])],
            tuple(int(v) for v in self.offsets[r, :nd]),
            tuple(int(v) for v in self.lengths[r, :nd]),
        )

    def tensors(self) -> dict[str, tuple[str, Shape]]:
        """fqn -> (dtype, global shape), in the order the rows first name them."""
        firsts = np.unique(self.first)
        names, dtypes = self.names, self.dtypes
        return dict(
            zip(
                [names[g] for g in self.name[firsts].tolist()],
                zip([dtypes[d] for d in self.dtype[firsts].tolist()], _tuples(self.shape[firsts], self.ndim[firsts])),
            )
        )


def _choose_writers(rows: _Rows, world: int) -> tuple[np.ndarray, np.ndarray]:
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


def _tiling_problems(rows: _Rows, chosen: np.ndarray, record_order: np.ndarray) -> list[str]:
    """Where the chosen boxes do not tile a tensor of any elements, in the tensors' order
    (``fqn: problem``, the boxes given to ``box_coverage_problem`` in the record order). Boxes
    that split a tensor along one dimension are checked on columns; the others, and tensors
    nobody writes, by ``box_coverage_problem``."""
    names = rows.name[chosen]
    full = rows.shape[chosen]
    offs, lens = rows.offsets[chosen], rows.lengths[chosen]
    cut = (offs != 0) | (lens != full)
    ncut = cut.sum(axis=1)
    dim = np.where(ncut == 1, cut.argmax(axis=1), -1)
    space = len(rows.names)
    split = np.full(space, -1, dtype=np.int64)
    np.maximum.at(split, names, dim)
    boxes = np.bincount(names, minlength=space)
    odd = np.zeros(space, dtype=bool)
    odd[names[(ncut > 1) | (dim != split[names])]] = True
    odd |= (split == -1) & (boxes != 1)
    along = split[names] >= 0
    d = np.maximum(split[names], 0)
    start = np.take_along_axis(offs, d[:, None], axis=1)[:, 0]
    end = start + np.take_along_axis(lens, d[:, None], axis=1)[:, 0]
    size = np.take_along_axis(full, d[:, None], axis=1)[:, 0]
    o = np.lexsort((start, names))
    g, st, en, sz = names[o], start[o], end[o], size[o]
    first = np.concatenate([[True], g[1:] != g[:-1]])
    last = np.concatenate([g[1:] != g[:-1], [True]])
    prev_end = np.concatenate([[0], en[:-1]])
    gap = np.where(first, st != 0, st != prev_end) | (last & (en != sz))
    odd[g[gap & along[o]]] = True
    firsts = np.unique(rows.first)  # each tensor's first row: the tensors' order
    tensor_names = rows.name[firsts]
    live = np.prod(rows.shape[firsts], axis=1) != 0
    check = np.zeros(space, dtype=bool)
    check[tensor_names[live]] = True  # names a table lists but no row uses are no tensors
    check &= odd | (boxes == 0)
    if not check.any():
        return []
    by_record = np.lexsort((record_order, names))  # by tensor, each tensor's boxes in the record order
    sorted_names = names[by_record]
    problems = []
    for t, r0 in zip(tensor_names.tolist(), firsts.tolist()):
        if not check[t]:
            continue
        a, b = np.searchsorted(sorted_names, [t, t + 1]).tolist()
        nd = int(rows.ndim[r0])
        shape = tuple(rows.shape[r0, :nd].tolist())
        written = chosen[by_record[a:b]].tolist()
        tiles = [(tuple(rows.offsets[r, :nd].tolist()), tuple(rows.lengths[r, :nd].tolist())) for r in written]
        problem = box_coverage_problem(shape, tiles)
        if problem is not None:
            problems.append(f"{rows.names[t]}: {problem}")
    return problems


def _tuples(values: np.ndarray, ndim: np.ndarray) -> list[tuple[int, ...]]:
    """Each row's first ``ndim`` values as a tuple of Python ints; rows that are alike share
    one tuple (a job's boxes repeat a few patterns: one tuple per pattern, not per row)."""
    if len(values) == 0:
        return []
    table = np.column_stack([ndim, values])
    key = np.zeros(len(table), dtype=np.int64)
    radix = 1
    for column in table.T:  # one integer per row pattern: mixed radix of the columns' codes
        codes, code = np.unique(column, return_inverse=True)
        if radix * len(codes) >= 1 << 62:
            return [tuple(row[1 : 1 + row[0]]) for row in table.tolist()]  # too many patterns
        key += code.reshape(-1) * radix
        radix *= len(codes)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    made = [tuple(row[1 : 1 + row[0]]) for row in table[first].tolist()]
    return [made[i] for i in inverse.reshape(-1).tolist()]


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
