"""Save planning: local plans from every rank -> one global plan (pure functions).

Runs on the coordinator (rank 0) in the plan stage (``engine.plan_cache``), after the gather of
the ranks' ``LocalSavePlan``s; the result is scattered back as ``RankSavePlan``s and reused (cached)
while the local plans do not change. ``plan_save`` is the one driver, on rank groups
(``templates.group_ranks``: ranks whose tables are equal up to their ``torch.chunk`` rows; one
group for an FSDP or DDP job of any size, one per rank for an irregular job). The rules, each
written once:
1. the ranks agree on each tensor's dtype and global shape (``rows.JobRows.disagreements``,
   worded rank by rank), sizes stay far inside int64 (``rows.MAX_TOTAL``, ``rows.MAX_BLOB``);
2. identical boxes on several ranks are replicas, each written once: by the replica a holder's
   spec names as ``replica_source`` (e.g. DDP buffers: rank 0 of the DDP group), else by the
   replica with the fewest bytes assigned so far (worst-fit, largest boxes first):
   ``writers.choose_writers`` over the groups;
3. the written boxes of each tensor neither overlap nor leave gaps (``rows.tiling_problems``,
   ``format.validation.box_coverage_problem``: the decoder's check);
4. split tensors: a tensor is split when its written boxes are ``torch.chunk`` parts over the
   ranks, rank r chunk r, every non-empty chunk once (``split.split_dims``'s rule). Writers are
   chosen before the split is decided. The groups keep the tensors whose every kept row is its
   rank's chunk (at most one per group, along one dimension, every rank with a non-empty chunk
   holding it: FSDP's ``Shard(0)``): each such chunk has one holder, so it is written by its
   rank and the tensor is split without expanding the groups. Every other tensor with chunk
   rows (chunks on some ranks and other boxes on others, a rank holding its chunk twice, chunks
   along several dimensions, a tensor without elements or split over part of the job) is
   grouped again with its boxes explicit (``group_ranks``' ``unsplit``), its writers chosen like
   any box's, and split if its written boxes are then chunks (its rows per rank:
   ``SplitTensors.override``). Split tensors are laid out alike in every rank's files and
   recorded as layouts (``split.split_parts``); where that would leave a rank without a file a
   layout names, only the tensors whose every chunk has rows are split, then none;
5. each rank's entries go into ``files_per_rank`` files, its split chunks first, then the rest
   largest first to the lightest file, each at a multiple of ENTRY_ALIGN bytes
   (``layout.lay_out_rank``; the chunks' offsets are computed when a rank's plan is asked for:
   ``templates.RegularRankPlans``).
Every refusal raises (``PlanningError``; an unknown dtype ``CorruptMetadataError``) with the
same words at every world size and grouping. The plain per-record statement of these rules is
the tests' oracle (tests/support/save_oracle.py), which this planner is property-tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...errors import PlanningError
from ...format.dtypes import itemsize
from ..specs import BlobSpec
from .layout import check_layout, lay_out_rank, padded, place_rest
from .model import GlobalSavePlan, LocalSavePlan, file_name
from .rows import MAX_BLOB, MAX_TOTAL, JobRows, tiling_problems, tuples
from .split import split_dims, split_parts
from .table import ShardTable
from .templates import RankGroup, RegularRankPlans, SplitTensors, group_ranks
from .writers import choose_writers

__all__ = ["plan_save"]

_NONE = np.zeros(0, dtype=np.int64)


def plan_save(
    local_plans: Sequence[LocalSavePlan | ShardTable], save_id: str, files_per_rank: int = 1
) -> GlobalSavePlan:
    """The global plan of every rank's local plan (records or tables: the coordinator passes
    ``wire.LocalPlans``, which decodes the gathered bytes when a table is asked for; module
    docstring); raises ``PlanningError`` for a job that cannot be saved."""
    if files_per_rank < 1:
        raise PlanningError("files_per_rank must be >= 1")
    world = len(local_plans)
    if world == 0:
        return GlobalSavePlan(save_id, (), (), {}, ())
    unsplit: set[str] = set()
    while True:
        groups, group_of, blobs = group_ranks(local_plans, unsplit)
        job = _Job.of(groups, group_of, world)
        again = {job.rows.names[g] for g in np.flatnonzero(job.regroup).tolist()}
        if not again:
            break
        unsplit |= again  # their boxes explicit: writers first, then the split rule
    return job.plan(blobs, save_id, files_per_rank)


class _Job:
    """One grouping of a job: the groups' rows, checked, and its tensors classified (``of``)."""

    def __init__(self, groups: list[RankGroup], group_of: np.ndarray, world: int, rows: JobRows) -> None:
        self.groups, self.group_of, self.world, self.rows = groups, group_of, world, rows
        self.ranks_of = [np.array(g.ranks, dtype=np.int64) for g in groups]
        self.group = np.repeat(np.arange(len(groups), dtype=np.int64), [len(g.table) for g in groups])
        self.rule = np.concatenate([g.rule for g in groups])
        self.regroup = np.zeros(len(rows.names), dtype=bool)
        # each tensor's global shape (padded), dtype and ndim, from its first row (names no row
        # uses: a 0-d float tensor of one element nobody writes)
        space, firsts = len(rows.names), rows.name[rows.first]
        self.t_shape = np.ones((space, rows.shape.shape[1]), dtype=np.int64)
        self.t_dtype = np.full(space, len(rows.dtypes), dtype=np.int64)
        self.t_ndim = np.zeros(space, dtype=np.int64)
        self.t_shape[firsts], self.t_dtype[firsts], self.t_ndim[firsts] = (
            rows.shape[rows.first],
            rows.dtype[rows.first],
            rows.ndim[rows.first],
        )

    @classmethod
    def of(cls, groups: list[RankGroup], group_of: np.ndarray, world: int) -> _Job:
        job = cls(groups, group_of, world, JobRows.of([g.table for g in groups]))  # sizes, dtypes refused
        problems = job.rows.disagreements(job.ranks_of, job.group)
        if problems:
            raise PlanningError("ranks disagree on tensor metadata:\n  " + "\n  ".join(problems[:20]))
        job._classify()
        return job

    def _classify(self) -> None:
        """``chunked``: per tensor id, whether the groups write it as chunks (module docstring,
        rule 4); ``regroup``: the tensors with chunk rows that are not (their boxes go
        explicit)."""
        rows, world = self.rows, self.world
        space = len(rows.names)
        kept = rows.kept
        ruled = (self.rule >= 0) & kept
        n_kept = np.bincount(rows.name[kept], minlength=space)
        n_ruled = np.bincount(rows.name[ruled], minlength=space)
        has = n_ruled > 0
        at = np.flatnonzero(ruled)
        g, d = rows.name[at], self.rule[at]
        low = np.full(space, np.iinfo(np.int64).max, dtype=np.int64)
        high = np.full(space, -1, dtype=np.int64)
        np.minimum.at(low, g, d)
        np.maximum.at(high, g, d)
        dim = np.maximum(high, 0)
        extent = self.t_shape[np.arange(space), dim]
        size = np.maximum(-(-extent // world), 1)
        chunks = -(-extent // size)
        numel = np.prod(self.t_shape, axis=1)
        pairs = np.unique(np.column_stack([g, self.group[at]]), axis=0) if len(at) else np.zeros((0, 2), np.int64)
        per_group = np.bincount(pairs[:, 0], minlength=space)  # groups holding a chunk row of it
        firsts = np.array([int(r[0]) for r in self.ranks_of], dtype=np.int64)  # ascending
        covered = np.bincount(pairs[:, 0], weights=firsts[pairs[:, 1]] < chunks[pairs[:, 0]], minlength=space)
        needed = np.searchsorted(firsts, chunks)  # the groups with a rank whose chunk is not empty
        ok = (n_ruled == n_kept) & (low == high) & (per_group == n_ruled) & (covered == needed) & (numel > 0)
        self.chunked = has & ok
        self.regroup = has & ~ok
        self.dim, self.extent, self.size, self.chunks = dim, extent, size, chunks

    def plan(self, blobs: list[tuple[BlobSpec, ...]], save_id: str, parts: int) -> GlobalSavePlan:
        rows, world = self.rows, self.world
        itemsizes = np.array([*map(itemsize, rows.dtypes), 1], dtype=np.int64)  # then: no row's dtype
        order = rows.name[np.unique(rows.first)]  # tensor ids in the job's tensor order
        numel = np.prod(self.t_shape, axis=1)

        # the chunked tensors' bytes on every rank (raw: what the writers and parts balance by)
        chunked = order[self.chunked[order]]
        c_bytes = numel[chunked] // np.maximum(self.extent[chunked], 1) * itemsizes[self.t_dtype[chunked]]
        c_loads = _chunk_sums(self.extent[chunked], self.size[chunked], c_bytes, _NONE[:0], 1, world)[0][:, 0]
        explicit = np.flatnonzero(~self.chunked[rows.name])
        ex = explicit[rows.kept[explicit]]
        sizes = np.array([len(r) for r in self.ranks_of], dtype=np.int64)
        total = float((rows.nbytes[ex].astype(np.float64) * sizes[self.group[ex]]).sum())  # every rank's bytes
        total += float((self.extent[chunked].astype(np.float64) * c_bytes).sum())  # chunks: the whole tensors
        if total > MAX_TOTAL:
            raise PlanningError(f"the job's tensors hold more than 2^{MAX_TOTAL.bit_length() - 1} bytes")
        for rank, own in enumerate(blobs):
            for b in own:
                if not 0 <= b.nbytes <= MAX_BLOB:
                    raise PlanningError(f"blob {b.key!r} of rank {rank}: {b.nbytes} bytes is outside [0, {MAX_BLOB}]")

        # writers of the explicit boxes, then the written boxes' tiling
        w_row, w_rank = self._writers(ex, explicit, c_loads)

        # split tensors: the chunked ones, and those whose written boxes are chunks
        w_dim, w_chunks = split_dims(
            rows.name[w_row],
            w_rank,
            rows.shape[w_row],
            rows.offsets[w_row],
            rows.lengths[w_row],
            len(rows.names),
            world,
        )
        dim = np.where(self.chunked, self.dim, w_dim)
        chunks = np.where(self.chunked, self.chunks, w_chunks)
        extent = self.t_shape[np.arange(len(dim)), np.maximum(dim, 0)]
        row_bytes = numel // np.maximum(extent, 1) * itemsizes[self.t_dtype]
        split = order[dim[order] >= 0]
        for attempt in (split, split[chunks[split] == world], _NONE):
            if attempt is not _NONE and not len(attempt):
                continue
            laid = self._lay_out(attempt, dim, extent, row_bytes, w_row, w_rank, blobs, save_id, parts)
            if laid is not None:
                return laid
        raise AssertionError("unreachable: a plan without split tensors names no layout file")

    def _writers(self, ex: np.ndarray, explicit: np.ndarray, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The row and rank writing each distinct explicit box (``writers.choose_writers``, each
        rank's chunked bytes counted), in (rank, row) order; refuses boxes that do not tile."""
        rows, world = self.rows, self.world
        singletons = len(self.groups) == world  # one group per rank: group g is rank g
        chosen, ranks, record_order = choose_writers(
            rows.names,
            rows.name[ex],
            rows.offsets[ex],
            rows.lengths[ex],
            rows.nbytes[ex],
            rows.source[ex],
            self.group[ex],
            loads,
            None if singletons else self.ranks_of,
            None if singletons else self.group_of,
        )
        later = record_order >= len(ex)  # the balanced boxes: after every row, in turn
        at = ex[np.minimum(record_order, len(ex) - 1)] if len(ex) else record_order
        record_order = np.where(later, record_order - len(ex) + len(rows.rank), at)
        among = np.zeros(len(rows.names), dtype=bool)
        among[rows.name[explicit]] = True
        problems = tiling_problems(rows, ex[chosen], record_order, among)
        if problems:
            raise PlanningError("the ranks' shards do not tile their tensors:\n  " + "\n  ".join(problems[:20]))
        at = ex[chosen]
        by = np.lexsort((rows.index[at], ranks))
        return at[by], ranks[by]

    def _lay_out(
        self,
        split: np.ndarray,
        dim: np.ndarray,
        extent: np.ndarray,
        row_bytes: np.ndarray,
        w_row: np.ndarray,
        w_rank: np.ndarray,
        blobs: list[tuple[BlobSpec, ...]],
        save_id: str,
        parts: int,
    ) -> GlobalSavePlan | None:
        """The plan with the tensors ``split`` (ids, job tensor order) laid out alike; None where
        a rank would lack a file a layout names."""
        rows, world, groups = self.rows, self.world, self.groups
        space = len(rows.names)
        is_split = np.zeros(space, dtype=bool)
        is_split[split] = True
        extent = extent[split]
        chunk = -(-extent // world)
        s_bytes = row_bytes[split]
        j_of = np.full(space, -1, dtype=np.int64)
        j_of[split] = np.arange(len(split))
        part = np.array(list(split_parts(list(range(len(split))), (chunk * s_bytes).tolist(), parts).values()))
        part = part.astype(np.int64).reshape(-1)
        item = np.full((len(groups), len(split)), -1, dtype=np.int64)
        ruled = np.flatnonzero((self.rule >= 0) & rows.kept & is_split[rows.name])
        item[self.group[ruled], j_of[rows.name[ruled]]] = rows.index[ruled]
        from_boxes = is_split[rows.name[w_row]]  # split tensors written from explicit boxes
        o_rank, o_row = w_rank[from_boxes], w_row[from_boxes]
        override = {
            r: (j_of[rows.name[o_row[o_rank == r]]], rows.index[o_row[o_rank == r]]) for r in np.unique(o_rank).tolist()
        }
        members = {k: np.flatnonzero(part == k) for k in range(parts)}
        s = SplitTensors(
            [rows.names[g] for g in split.tolist()], dim[split], extent, chunk, s_bytes, part, item, override, members
        )
        loads, ends, uses = _chunk_sums(extent, chunk, s_bytes, part, parts, world)  # (world, parts) each

        # the boxes written outside the layouts: explicit writers, and chunks of unsplit tensors
        keep = ~from_boxes
        e_row, e_rank = w_row[keep], w_rank[keep]
        c_ids = np.flatnonzero(self.chunked & ~is_split)
        c_rank, c_tensor, c_item, c_offs, c_lens = self._chunk_boxes(c_ids)
        e_name = np.concatenate([rows.name[e_row], c_tensor])
        e_ranks = np.concatenate([e_rank, c_rank])
        e_item = np.concatenate([rows.index[e_row], c_item])
        e_ndim = np.concatenate([rows.ndim[e_row], self.t_ndim[c_tensor]])
        e_offs = np.concatenate([rows.offsets[e_row], c_offs])
        e_lens = np.concatenate([rows.lengths[e_row], c_lens])
        itemsizes = np.array([*map(itemsize, rows.dtypes), 1], dtype=np.int64)  # then: no row's dtype
        e_bytes = np.prod(e_lens, axis=1) * itemsizes[self.t_dtype[e_name]]
        by = np.lexsort((e_item, e_ranks))
        e_name, e_ranks, e_item, e_ndim, e_offs, e_lens, e_bytes = (
            a[by] for a in (e_name, e_ranks, e_item, e_ndim, e_offs, e_lens, e_bytes)
        )
        names = rows.names
        writers = tuple(
            zip(
                [names[g] for g in e_name.tolist()],
                tuples(e_offs, e_ndim),
                tuples(e_lens, e_ndim),
                e_ranks.tolist(),
                e_item.tolist(),
            )
        )

        # each rank's explicit entries and blobs, largest first to the lightest part
        placed: dict[int, tuple[np.ndarray, list[str]]] = {}
        checked: list[tuple[np.ndarray, ...]] = []  # per rank: owner, rank, part, offset, nbytes
        blob_keys: list[str] = []
        bounds = np.searchsorted(e_ranks, np.arange(world + 1))
        for rank in range(world):
            lo, hi = int(bounds[rank]), int(bounds[rank + 1])
            own = blobs[rank]
            if lo == hi and not own:
                continue
            sizes = np.concatenate([e_bytes[lo:hi], np.array([b.nbytes for b in own], dtype=np.int64)])
            n = hi - lo
            if len(split):
                tie = np.arange(len(sizes), dtype=np.int64)  # boxes by item, then blobs by key
                tie[[n + i for i in sorted(range(len(own)), key=lambda i: own[i].key)]] = np.arange(n, len(sizes))
                order, at_part, at = place_rest(sizes, tie, loads[rank], ends[rank])
            else:  # boxes by item, then blobs in their order
                order, at_part, at = lay_out_rank(sizes, parts)
            by_part = np.argsort(at_part, kind="stable")  # by part, each part's in placement order
            order, at_part, at = order[by_part], at_part[by_part], at[by_part]
            is_blob = order >= n
            out = np.empty((len(order), 5), dtype=np.int64)
            out[:, 0] = np.where(is_blob, -1, e_item[lo:hi][np.minimum(order, max(n - 1, 0))] if n else -1)
            out[:, 1], out[:, 2], out[:, 3] = at_part, at, sizes[order]
            out[:, 4] = np.where(is_blob, np.cumsum(is_blob) - 1, -1)
            keys = [own[i - n].key for i in order[is_blob].tolist()]
            placed[rank] = (out, keys)
            uses[rank, at_part] = True
            owner = np.where(
                is_blob, space + 1 + len(blob_keys) + out[:, 4], e_name[lo:hi][np.minimum(order, n - 1)] if n else 0
            )
            checked.append((owner, np.full(len(out), rank), at_part, at, out[:, 3]))
            blob_keys.extend(keys)
        used = sorted(set(part.tolist()))
        if not uses[:, used].all():
            return None  # a rank would lack a file a layout names: fewer split tensors
        rank_parts = [tuple(np.flatnonzero(u).tolist()) for u in uses]
        files = tuple(file_name(r, k) for r in range(world) for k in rank_parts[r])
        index = {f: i for i, f in enumerate(files)}
        slot = (np.cumsum(uses.ravel()) - 1).reshape(world, parts)  # each (rank, part)'s index in files
        region_rank, region_part = np.nonzero(ends > 0)  # each rank's split chunks, one range per part
        owner, rank_of, part_of, offset, nbytes = (
            np.concatenate([c[k] for c in checked] + [extra]).astype(np.int64)
            for k, extra in enumerate(
                (np.full(len(region_rank), space), region_rank, region_part, np.zeros(len(region_rank)), ends[ends > 0])
            )
        )
        check_layout(
            files, [(owner, slot[rank_of, part_of], offset, nbytes)], [*rows.names, "split chunks", *blob_keys]
        )
        layouts = tuple(
            (
                tuple(index[file_name(r, k)] for r in range(world)),
                tuple((s.fqns[j], int(s.dims[j])) for j in np.flatnonzero(part == k).tolist()),
            )
            for k in used
        )
        plans = RegularRankPlans(save_id, world, s, self.group_of, placed, rank_parts)
        return GlobalSavePlan(save_id, plans, files, rows.tensors(), writers, layouts)

    def _chunk_boxes(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """The non-empty chunks of the chunked tensors ``ids`` as boxes: per box its rank, tensor
        id, row in its rank's plan, offsets and lengths (padded)."""
        rows, world = self.rows, self.world
        width = rows.shape.shape[1]
        if not len(ids):
            return _NONE, _NONE, _NONE, np.zeros((0, width), np.int64), np.zeros((0, width), np.int64)
        n = _rows_of(np.arange(world)[:, None], self.extent[ids], self.size[ids])  # (world, ids)
        rank, j = np.nonzero(n > 0)
        tensor = ids[j]
        ruled = np.flatnonzero((self.rule >= 0) & rows.kept & np.isin(rows.name, ids))
        space = len(rows.names)
        keys = self.group[ruled] * space + rows.name[ruled]  # one kept chunk row per group and tensor
        by = np.argsort(keys)
        found = by[np.searchsorted(keys[by], self.group_of[rank] * space + tensor)]
        d = self.dim[tensor]
        offs = np.zeros((len(rank), width), dtype=np.int64)
        lens = self.t_shape[tensor]
        offs[np.arange(len(rank)), d] = np.minimum(self.extent[tensor], rank * self.size[tensor])
        lens[np.arange(len(rank)), d] = n[rank, j]
        return rank, tensor, rows.index[ruled[found]], offs, lens


def _rows_of(rank: np.ndarray, extent: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Rows of ``torch.chunk`` part ``rank`` of ``extent`` rows in chunks of ``size``."""
    lo = np.minimum(extent, rank * size)
    return np.minimum(extent, lo + size) - lo


def _chunk_sums(
    extent: np.ndarray, size: np.ndarray, row_bytes: np.ndarray, part: np.ndarray, parts: int, world: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank and part (``part``: each tensor's; empty: all in part 0): the bytes of the
    ``torch.chunk``s (``extent`` rows in chunks of ``size``, ``row_bytes`` each), the bytes they
    take aligned, and whether there is one. Ranks below ``extent // size`` hold ``size`` rows,
    the next one the rest: sums of differences over the ranks, never a (ranks, tensors) array."""
    if not len(part):
        part = np.zeros(len(extent), dtype=np.int64)
    full = extent // size
    rest = extent - full * size
    diffs = np.zeros((3, world + 2, parts), dtype=np.int64)
    for k, (whole, tail) in enumerate(
        (
            (size * row_bytes, rest * row_bytes),
            (padded(size * row_bytes), padded(rest * row_bytes)),
            (size > 0, rest > 0),
        )
    ):
        np.add.at(diffs[k], (np.zeros_like(full), part), whole)  # ranks 0 .. full - 1: a whole chunk
        np.add.at(diffs[k], (full, part), np.asarray(tail, dtype=np.int64) - whole)  # rank full: the rest
        np.add.at(diffs[k], (full + 1, part), -np.asarray(tail, dtype=np.int64))
    sums = np.cumsum(diffs, axis=1)[:, :world]
    return sums[0], sums[1], sums[2] > 0
