"""A distributed load's read assignment over the whole job's needs as columns (pure, numpy).

Called by the coordinator (``engine.read_exchange.read_parts``) with every rank's needs, each an
array of ``NEED_DTYPE`` rows (tensor number in the metadata's order, shard, first and end row of
the shard its copies touch), concatenated in rank order. It decides what
the read assignment's rule (``planning.read_assignment``) decides over Python lists (the tests'
reference, ``tests/read_fixtures.py``), with every pass over the
needs vectorised, so the coordinator's work grows with the job's needs at numpy speed and its
Python loops with the segments and batches only (a whole-job reshard of 4,096 FSDP ranks sends
millions of needs):

1. ``shard_geometry``: file, byte offset, length and row bytes of every need's shard (regular
   layouts' chunks by arithmetic: ``SplitLayout.locations``; listed shards from their records).
2. ``classify``: how many ranks need each shard; the bytes each rank reads alone (shards only it
   needs); of the shards several ranks need, those read by each for its own rows (the same test
   as ``disjoint_needs``: rows pairwise disjoint, and the checksum chunks their reads cover
   overlapping by at most an eighth of what they cover together).
3. ``assign_columns``: every other shared shard gets one reader, by the rule, the alone bytes
   counted in the balancing: shards in file order cut into segments, segments largest
   first to the least-loaded consumer, batches per (reader, consumers) of at most
   ``max_batch_bytes``. Batches come out as ``ColumnBatch`` (keys as arrays), so that a rank's
   part is cut from them without a Python object per need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import PlanningError
from ..format.dtypes import itemsize
from ..format.layouts import SplitLayout, SplitShards
from ..format.records import Metadata

__all__ = [
    "NEED_DTYPE",
    "Classified",
    "ColumnBatch",
    "Extents",
    "JobNeeds",
    "assign_columns",
    "classify",
    "shard_geometry",
]

# one need: (tensor number in ``Metadata.tensors`` order, shard index, first row, end row)
NEED_DTYPE = np.dtype([("tensor", "<i4"), ("shard", "<i4"), ("lo", "<i8"), ("hi", "<i8")])
Extents = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # files, lo, hi
_ALIGN = 64  # batch offsets (planning.read_assignment._ALIGN)
_BLOCK = 1 << 20  # needs per block of a vectorised pass whose temporaries would be many


@dataclass(frozen=True)
class JobNeeds:
    """Every rank's needs as columns, concatenated in rank order: need ``j`` is rows
    ``[lo[j], hi[j])`` of shard ``shard[j]`` of tensor ``tensor[j]`` (its number in the
    metadata's order), needed by rank ``rank[j]``; ``key[j]``: its shard's number across the
    job (tensor-major). Numbers that fit in 32 bits are kept in 32 (a whole-job reshard of
    thousands of ranks has millions of needs)."""

    tensor: np.ndarray  # int32
    shard: np.ndarray  # int32
    lo: np.ndarray  # int64
    hi: np.ndarray  # int64
    rank: np.ndarray  # int32
    key: np.ndarray  # int64
    total_keys: int  # shards across the job (every key is below it)

    def __len__(self) -> int:
        return len(self.key)

    @classmethod
    def of(cls, md: Metadata, per_rank: Sequence[np.ndarray]) -> JobNeeds:
        """From each rank's ``NEED_DTYPE`` rows; a tensor or shard number out of range, or rows
        out of order, is a PlanningError."""
        if len(per_rank) >= 1 << 31:
            raise PlanningError(f"{len(per_rank)} ranks: more than the read assignment counts")

        def column(name: str) -> np.ndarray:
            return np.concatenate([n[name] for n in per_rank]) if per_rank else np.zeros(0, NEED_DTYPE[name])

        tensor, shard, lo, hi = (column(name) for name in ("tensor", "shard", "lo", "hi"))
        counts = np.fromiter((len(t.shards) for t in md.tensors.values()), dtype=np.int64, count=len(md.tensors))
        base = np.concatenate([[0], np.cumsum(counts)])
        kind = np.int32 if int(base[-1]) < 1 << 31 else np.int64  # shard numbers across the job
        key = np.zeros(0, dtype=kind)
        if len(tensor):
            if tensor.min() < 0 or tensor.max() >= len(counts) or shard.min() < 0 or np.any(shard >= counts[tensor]):
                raise PlanningError("a rank reported a need of a tensor or shard this checkpoint does not have")
            key = base.astype(kind)[tensor] + shard.astype(kind, copy=False)  # below base[-1]: no overflow
            if lo.min() < 0 or np.any(lo > hi):
                raise PlanningError("a rank reported a need of rows out of order")
        rank = np.repeat(np.arange(len(per_rank), dtype=np.int32), [len(n) for n in per_rank])
        return cls(tensor, shard, _narrow(lo), _narrow(hi), rank, key, int(base[-1]))


def _narrow(values: np.ndarray) -> np.ndarray:
    """``values`` (non-negative integers) as int32 when they all fit, else as int64."""
    if not len(values) or int(values.max()) < 1 << 31:
        return values.astype(np.int32)
    return values.astype(np.int64)


def shard_geometry(
    md: Metadata, tensor: np.ndarray, shard: np.ndarray, block: int = 1 << 20
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(file index, byte offset, byte length, bytes per row of the first dimension) of each
    need's shard: ``format.layouts.shard_location`` / ``shard_row_bytes``, for many at once, in
    blocks of ``block`` needs (temporaries stay small; only the answer is allocated whole)."""
    n = len(tensor)
    out = [np.zeros(n, dtype=np.int32 if i == 0 else np.int64) for i in range(4)]  # file numbers fit 32 bits
    records = list(md.tensors.values())
    used = np.zeros(len(records) + 1, dtype=bool)
    used[tensor] = True
    layouts: dict[int, tuple[SplitLayout, list[int], list[int]]] = {}  # id -> (layout, tensors, entries)
    listed: list[int] = []
    for t in np.flatnonzero(used[:-1]).tolist():
        shards = records[t].shards
        if isinstance(shards, SplitShards):
            _, ts, es = layouts.setdefault(id(shards.layout), (shards.layout, [], []))
            ts.append(t)
            es.append(shards.entry)
        else:
            listed.append(t)
    plans = []
    for layout, ts, es in layouts.values():
        entry_of = np.full(len(records), -1, dtype=np.int64)
        entry_of[ts] = es
        parts = np.zeros(max(1, layout.parts), dtype=bool)
        for a in range(0, n, block):
            mine = entry_of[tensor[a : a + block]] >= 0
            parts[shard[a : a + block][mine]] = True
        plans.append((layout, entry_of, layout.offset_table(np.flatnonzero(parts))))
    table = np.zeros((0, 4), dtype=np.int64)
    first = np.zeros(len(records), dtype=np.int64)
    is_listed = np.zeros(len(records), dtype=bool)
    if listed:
        rows: list[tuple[int, int, int, int]] = []
        for t in listed:
            rec = records[t]
            first[t] = len(rows)
            isz = itemsize(rec.dtype)
            for s in rec.shards:
                rb = int(np.prod(s.lengths[1:], dtype=np.int64)) * isz if s.lengths else isz
                rows.append((s.file_index, s.byte_offset, s.byte_length, rb))
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
        is_listed[listed] = True
    for a in range(0, n, block):  # each need's values from its layout or its listed shard
        tb, sh = tensor[a : a + block], shard[a : a + block].astype(np.int64)
        found: tuple[np.ndarray, ...] | None = None
        for layout, entry_of, offsets in plans:
            entries = entry_of[tb]
            mine = entries >= 0
            # the other needs ask a chunk that exists (part 0's of entry 0 when present, else
            # any present part's), then keep their own values
            some_part = int(np.argmax(offsets[1] >= 0))
            got: tuple[np.ndarray, ...] = layout.locations(
                np.maximum(entries, 0), np.where(mine, sh, some_part), offsets
            )
            found = got if found is None else tuple(np.where(mine, x, y) for x, y in zip(got, found))
        if listed:
            mine = is_listed[tb]
            at = np.where(mine, first[tb] + sh, 0)
            got = tuple(table[:, i][at] for i in range(4))
            found = got if found is None else tuple(np.where(mine, x, y) for x, y in zip(got, found))
        assert found is not None
        for column, values in zip(out, found):
            column[a : a + len(tb)] = values
    return out[0], out[1], out[2], out[3]


@dataclass(frozen=True)
class Classified:
    """``classify``'s answer. Per need: ``count`` (ranks needing its shard), ``apart`` (read by
    its rank for its own rows); per rank: ``loads`` (bytes of shards only it needs)."""

    count: np.ndarray
    apart: np.ndarray
    loads: np.ndarray
    # shards two ranks need: their first and second need (in need order, so rank order)
    first: np.ndarray
    second: np.ndarray


def classify(
    job: JobNeeds, geometry: tuple[np.ndarray, ...], world: int, extents: Extents, total_keys: int
) -> Classified:
    """Counts, alone bytes and the disjoint-rows test (module docstring, step 2)."""
    files, offsets, lengths, row_bytes = geometry
    per_key = np.bincount(job.key, minlength=total_keys).astype(np.int32)  # ranks: fewer than 2**31
    count = per_key[job.key]
    del per_key
    alone = count == 1
    loads = np.bincount(job.rank[alone], weights=lengths[alone], minlength=world).astype(np.int64)
    del alone
    apart = np.zeros(len(count), dtype=bool)
    lo, hi = job.lo, job.hi
    # two ranks: exact, vectorised, in blocks (temporaries stay small)
    pairs = np.flatnonzero(count == 2)
    first = second = np.zeros(0, dtype=np.int64)
    if len(pairs):
        first, second = _first_and_last(job.key[pairs], pairs, total_keys)
    del pairs
    for s in range(0, len(first), _BLOCK):
        a, b = first[s : s + _BLOCK], second[s : s + _BLOCK]
        swap = (lo[b] < lo[a]) | ((lo[b] == lo[a]) & (hi[b] < hi[a]))  # a, b in row order
        a, b = np.where(swap, b, a), np.where(swap, a, b)
        rows_apart = lo[b] >= hi[a]
        ca = extents(files[a], offsets[a] + lo[a] * row_bytes[a], offsets[a] + hi[a] * row_bytes[a])
        cb = extents(files[b], offsets[b] + lo[b] * row_bytes[b], offsets[b] + hi[b] * row_bytes[b])
        swap = (cb[0] < ca[0]) | ((cb[0] == ca[0]) & (cb[1] < ca[1]))  # covers in order
        l1, h1 = np.where(swap, cb[0], ca[0]), np.where(swap, cb[1], ca[1])
        l2, h2 = np.where(swap, ca[0], cb[0]), np.where(swap, ca[1], cb[1])
        twice = np.maximum(0, np.minimum(h2, h1) - l2)
        union = np.maximum(0, h1 - l1) + np.maximum(0, h2 - np.maximum(l2, h1))
        ok = rows_apart & (8 * twice <= union)
        apart[a[ok]] = True
        apart[b[ok]] = True
    # three ranks or more: the same test over each shard's needs sorted by rows
    many = np.flatnonzero(count > 2)
    if len(many):  # first, rows whose lengths add up past their span overlap (replicated state)
        keys = job.key[many]
        span_lo = np.full(total_keys, np.iinfo(lo.dtype).max, dtype=lo.dtype)  # types alike: ufunc.at's fast path
        span_hi = np.zeros(total_keys, dtype=hi.dtype)
        np.minimum.at(span_lo, keys, lo[many])
        np.maximum.at(span_hi, keys, hi[many])
        summed = np.bincount(keys, weights=(hi[many] - lo[many]).astype(np.float64), minlength=total_keys)
        many = many[summed[keys] <= span_hi[keys] - span_lo[keys]]
    if len(many):
        many = many[np.lexsort((hi[many], lo[many], job.key[many]))]
        group = np.concatenate([[0], np.cumsum(job.key[many][1:] != job.key[many][:-1])])
        opens = np.concatenate([[True], group[1:] != group[:-1]])
        m_lo, m_hi = lo[many], hi[many]
        overlap = ~opens & (m_lo < np.concatenate([[0], m_hi[:-1]]))  # rows meet the previous need's
        rows_apart = np.bincount(group, weights=overlap.astype(np.float64)) == 0
        # the covers in order, per shard: what each covers twice is what it shares with the
        # covers before it (their running end)
        m_off, m_rb = offsets[many], row_bytes[many]
        c_lo, c_hi = extents(files[many], m_off + m_lo * m_rb, m_off + m_hi * m_rb)
        by_cover = np.lexsort((c_hi, c_lo, group))
        c_lo, c_hi = c_lo[by_cover], c_hi[by_cover]
        span = int(c_hi.max()) + 2
        lifted = np.maximum.accumulate(c_hi + group * span)
        end = np.where(opens, -1, np.concatenate([[0], lifted[:-1]]) - group * span)
        twice = np.bincount(group, weights=np.maximum(0, np.minimum(c_hi, end) - c_lo).astype(np.float64))
        union = np.bincount(group, weights=np.maximum(0, c_hi - np.maximum(c_lo, end)).astype(np.float64))
        ok = rows_apart & (8 * twice <= union)
        apart[many[ok[group]]] = True
    return Classified(count, apart, loads, first, second)


def _first_and_last(keys: np.ndarray, index: np.ndarray, total_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """For needs ``index`` whose shards two ranks need (``keys``): each need's first and last
    need of its shard (the two, in need order), as need numbers."""
    kind = np.int32 if len(index) and int(index.max()) < 1 << 31 else np.int64  # need numbers
    first = np.full(total_keys, np.iinfo(kind).max, dtype=kind)
    last = np.full(total_keys, -1, dtype=kind)
    index_kind = index.astype(kind)  # the same type as the table: ufunc.at's fast path
    np.minimum.at(first, keys, index_kind)
    np.maximum.at(last, keys, index_kind)
    mine = index == first[keys]
    return index[mine], last[keys[mine]]


@dataclass(frozen=True)
class ColumnBatch:
    """One batch of the assignment with its keys as positions: ``keys[start:end]`` of the
    ``assign_columns`` answer (each a need number whose shard it is), in the batch's order."""

    batch_id: int
    reader: int
    consumers: tuple[int, ...]
    start: int
    end: int
    nbytes: int


def assign_columns(
    job: JobNeeds,
    located: tuple[np.ndarray, np.ndarray, np.ndarray],
    found: Classified,
    extents: Extents,
    segment_bytes: int,
    max_batch_bytes: int = 64 << 20,
) -> tuple[list[ColumnBatch], np.ndarray, np.ndarray]:
    """Readers and batches for the shards several ranks need, none read apart:
    the rule (``planning.read_assignment``) over them, with ``found.loads`` counted. Returns
    the batches, each batch key's representative need (``keys``) and the offsets of the keys in
    their batches, both in batch order."""
    files, offsets, lengths = located  # each need's shard's file, byte offset, byte length
    # each shard (any order: file order comes next): its first need and its consumers, ascending
    # (cons[starts[i]:ends[i]]); shards of two ranks straight from classify's pairs
    kept = ~found.apart[found.first]
    pair_a, pair_b = found.first[kept], found.second[kept]
    many = np.flatnonzero((found.count > 2) & ~found.apart)
    many = many[np.argsort(job.key[many], kind="stable")]  # by shard, then rank
    many_keys = job.key[many]
    many_starts = np.flatnonzero(np.concatenate([[True], many_keys[1:] != many_keys[:-1]])) if len(many) else many
    if not len(pair_a) and not len(many):
        return [], np.zeros(0, np.int64), np.zeros(0, np.int64)
    rep = np.concatenate([pair_a, many[many_starts]])
    cons = np.concatenate([np.stack([job.rank[pair_a], job.rank[pair_b]], axis=1).ravel(), job.rank[many]])
    starts = np.concatenate([np.arange(0, 2 * len(pair_a), 2), 2 * len(pair_a) + many_starts]).astype(np.int64)
    ends = np.concatenate([starts[1:], [len(cons)]])
    k_file, k_off, k_len = files[rep], offsets[rep], lengths[rep]
    # file order; ties by first appearance (the order the rule over Python lists sorts stably)
    by_loc = np.lexsort((rep, k_off, k_file))
    c_lo, c_hi = extents(k_file[by_loc], k_off[by_loc], k_off[by_loc] + k_len[by_loc])
    seg_of = _segments(k_file[by_loc], k_len[by_loc], c_lo, c_hi, segment_bytes)
    n_seg = int(seg_of[-1]) + 1
    seg_bytes = np.bincount(seg_of, weights=k_len[by_loc].astype(np.float64), minlength=n_seg).astype(np.int64)
    seg_first = np.flatnonzero(np.concatenate([[True], np.diff(seg_of) != 0]))
    seg_rank = np.lexsort((np.arange(n_seg), k_off[by_loc][seg_first], k_file[by_loc][seg_first], -seg_bytes))
    # each key's consumers again, in file order, so that a segment's are one slice
    width = ends - starts
    w_loc = width[by_loc]
    ptr = np.concatenate([[0], np.cumsum(w_loc)])
    within = np.arange(int(ptr[-1]), dtype=np.int64) - np.repeat(ptr[:-1], w_loc)
    cons_loc = cons[np.repeat(starts[by_loc], w_loc) + within]
    load = found.loads.astype(np.int64).copy()
    reader_of_seg = np.zeros(n_seg, dtype=np.int64)
    seg_end = np.concatenate([seg_first[1:], [len(by_loc)]])
    for seg in seg_rank.tolist():
        who = cons_loc[ptr[seg_first[seg]] : ptr[seg_end[seg]]]
        held = load[who]
        r = int(who[held == held.min()].min())  # the least-loaded consumer, the lowest rank on ties
        reader_of_seg[seg] = r
        load[r] += seg_bytes[seg]
    reader = np.empty(len(rep), dtype=np.int64)
    reader[by_loc] = reader_of_seg[seg_of]
    # batches: per (reader, consumers), in that order, keys in file order
    sets: dict[tuple[int, ...], int] = {}
    set_of = np.empty(len(rep), dtype=np.int64)
    two = width == 2
    pair = cons[starts].astype(np.int64) * (1 << 32) + np.where(two, cons[np.minimum(starts + 1, len(cons) - 1)], 0)
    for i in np.flatnonzero(~two).tolist():
        set_of[i] = sets.setdefault(tuple(cons[starts[i] : ends[i]].tolist()), len(sets))
    if np.any(two):
        uniq, inv = np.unique(pair[two], return_inverse=True)
        ids = [sets.setdefault((int(u) >> 32, int(u) & 0xFFFFFFFF), len(sets)) for u in uniq.tolist()]
        set_of[two] = np.asarray(ids, dtype=np.int64)[inv]
    ranked = sorted(sets, key=lambda t: t)
    set_rank = np.empty(len(sets), dtype=np.int64)
    set_rank[[sets[t] for t in ranked]] = np.arange(len(ranked))
    in_file_order = np.empty(len(rep), dtype=np.int64)
    in_file_order[by_loc] = np.arange(len(rep))
    final = np.lexsort((in_file_order, set_rank[set_of], reader))
    f_reader, f_set, f_len = reader[final], set_rank[set_of][final], k_len[final]
    group_start = np.flatnonzero(np.concatenate([[True], (np.diff(f_reader) != 0) | (np.diff(f_set) != 0)]))
    group_end = np.concatenate([group_start[1:], [len(final)]])
    aligned = -(-f_len // _ALIGN) * _ALIGN
    pos = np.concatenate([[0], np.cumsum(aligned)])
    reach = pos[:-1] + f_len  # a key fits while (its start in the batch) + its length <= max
    batch_offsets = np.empty(len(final), dtype=np.int64)
    batches: list[ColumnBatch] = []
    for g0, g1 in zip(group_start.tolist(), group_end.tolist()):
        consumers = ranked[int(f_set[g0])]
        s = g0
        while s < g1:
            # the first key after s that would end past max_batch_bytes starts the next batch
            e = min(g1, max(s + 1, int(np.searchsorted(reach, pos[s] + max_batch_bytes, side="right"))))
            batch_offsets[s:e] = pos[s:e] - pos[s]
            batches.append(ColumnBatch(len(batches), int(f_reader[s]), consumers, s, e, int(pos[e] - pos[s])))
            s = e
    return batches, rep[final], batch_offsets


def _segments(files: np.ndarray, lengths: np.ndarray, c_lo: np.ndarray, c_hi: np.ndarray, least: int) -> np.ndarray:
    """Segment number of each key (in file order), as the rule cuts them. A cut goes
    before key j where its file changes, or where the segment so far holds ``least`` bytes and
    j's covered bytes start at or after the segment's end."""
    n = len(files)
    new_file = np.concatenate([[True], files[1:] != files[:-1]])
    # what the keys before j in j's file cover, up to where: a running maximum per file (each
    # file's values lifted above the previous files'); equal to the open segment's end, since a
    # segment starts at a key whose covered bytes start past every earlier key's
    file_no = np.cumsum(new_file) - 1
    span = int(c_hi.max()) + 1
    prev_end = np.concatenate([[-1], np.maximum.accumulate(c_hi + file_no * span)[:-1]]) - file_no * span
    candidate = ~new_file & (c_lo >= prev_end)
    # for every position: the next file change after it, the next possible cut at or after it
    index = np.arange(n + 1, dtype=np.int64)
    next_forced = np.minimum.accumulate(np.where(np.append(new_file, True), index, n)[::-1])[::-1][1:]
    next_cand = np.minimum.accumulate(np.where(np.append(candidate | new_file, True), index, n)[::-1])[::-1]
    prefix = np.concatenate([[0], np.cumsum(lengths)])
    cut = [0]
    s = 0
    while True:
        enough = int(np.searchsorted(prefix, prefix[s] + least, side="left"))  # bytes [s, j) >= least
        nxt = min(int(next_forced[s]), int(next_cand[min(max(enough, s + 1), n)]))
        if nxt >= n:
            break
        cut.append(nxt)
        s = nxt
    seg = np.zeros(n, dtype=np.int64)
    seg[np.asarray(cut[1:], dtype=np.int64)] = 1
    return np.cumsum(seg)
