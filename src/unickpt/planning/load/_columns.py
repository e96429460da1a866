"""The read assignment over the whole job's needs as columns (pure, numpy): the private
implementation of ``planning.load.assign.assign_reads``.

Run by ``assign_reads`` (at the coordinator) on every rank's needs, each an array of
``NEED_DTYPE`` rows (tensor number in the metadata's order, shard, first and end row of the
shard its copies touch), concatenated in rank order. It decides what the rule written plainly
over Python lists (``planning.load.assign.plain_parts``, the spec) decides, with every pass over
the needs vectorised, so the coordinator's work grows with the job's needs at numpy speed and its
Python loops with the segments and batches only (a whole-job reshard of 4,096 FSDP ranks sends
millions of needs):

1. ``JobNeeds.of``: the columns (each rank's fields copied straight in; the checks and the
   shard numbers across the job computed in blocks of ``BLOCK`` needs).
2. ``classify``: how many ranks need each shard; the bytes each rank reads alone (shards only it
   needs: their byte lengths alone, ``ShardLookup.lengths``); of the shards several ranks need
   (their geometry looked up once per shard: ``ShardLookup.geometry``), those read by each for
   its own rows (the same test as ``disjoint_needs``: rows pairwise disjoint, and the checksum
   chunks their reads cover overlapping by at most an eighth of what they cover together).
   Shards every rank needs in overlapping rows (replicated state) keep no list of their needs:
   all ranks are their consumers. The blocks, the pairs and the groups of three or more ranks
   are worked on by the caller's ``map`` (a thread pool's: numpy's loops release the GIL).
3. ``assign_columns``: every other shared shard gets one reader, by the rule, the alone bytes
   counted in the balancing: shards in file order cut into segments, segments largest
   first to the least-loaded consumer, batches per (reader, consumers) of at most
   ``max_batch_bytes``. Batches come out as ``ColumnBatch`` (keys as arrays), so that a rank's
   part is cut from them without a Python object per need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import PlanningError
from ...format.records import Metadata
from .runs import Extents
from .shards import BLOCK, ShardLookup

__all__ = [
    "NEED_DTYPE",
    "Classified",
    "ColumnBatch",
    "JobNeeds",
    "Map",
    "assign_columns",
    "classify",
    "segment_bytes",
]

# one need: (tensor number in ``Metadata.tensors`` order, shard index, first row, end row)
NEED_DTYPE = np.dtype([("tensor", "<i4"), ("shard", "<i4"), ("lo", "<i8"), ("hi", "<i8")])
# ``map``-like: applies a function to each item; a thread pool's ``map`` starts every call at
# once (so a call whose result is taken later overlaps the work in between), the builtin runs
# them one by one as their results are taken
Map = Callable[[Callable[[Any], Any], Iterable[Any]], Iterator[Any]]
Where = tuple[np.ndarray, np.ndarray, np.ndarray]  # per shard: file, byte offset, byte length
_ALIGN = 64  # batch offsets (as planning.load.assign's plain rule)


@dataclass(frozen=True)
class JobNeeds:
    """Every rank's needs as columns, concatenated in rank order: need ``j`` is rows
    ``[lo[j], hi[j])`` of shard ``shard[j]`` of tensor ``tensor[j]`` (its number in the
    metadata's order), needed by rank ``rank[j]``; ``key[j]``: its shard's number across the
    job (``_numbering``: like-numbered shards of tensors with as many shards together). Numbers
    that fit in 32 bits are kept in 32 (a whole-job reshard of thousands of ranks has millions
    of needs)."""

    tensor: np.ndarray  # int32
    shard: np.ndarray  # int32
    lo: np.ndarray  # int32 or int64
    hi: np.ndarray  # int32 or int64
    rank: np.ndarray  # int32
    key: np.ndarray  # intp
    total_keys: int  # shards across the job (every key is below it)

    def __len__(self) -> int:
        return len(self.key)

    @classmethod
    def of(cls, md: Metadata, per_rank: Sequence[np.ndarray], run: Map = map) -> JobNeeds:
        """From each rank's ``NEED_DTYPE`` rows; a tensor or shard number out of range, or rows
        out of order, is a PlanningError. Each field goes straight into its column and the
        checks run in blocks, through ``run`` (the columns are the only whole-job
        allocations)."""
        world = len(per_rank)
        if world >= 1 << 31:
            raise PlanningError(f"{world} ranks: more than the read assignment counts")
        sizes = [len(n) for n in per_rank]
        n = sum(sizes)
        counts = np.fromiter((len(t.shards) for t in md.tensors.values()), dtype=np.int64, count=len(md.tensors))
        first_key, stride = _numbering(counts)
        wide = any(len(x) and (int(x["lo"].min()) < -(1 << 31) or int(x["hi"].max()) >= 1 << 31) for x in per_rank)
        rows = np.int64 if wide else np.int32
        tensor, shard = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32)
        lo: np.ndarray = np.empty(n, dtype=rows)
        hi: np.ndarray = np.empty(n, dtype=rows)
        at = 0
        for x in per_rank:  # field by field (a concatenation of the records first costs 3x)
            m = len(x)
            tensor[at : at + m], shard[at : at + m], lo[at : at + m], hi[at : at + m] = (
                x["tensor"],
                x["shard"],
                x["lo"],
                x["hi"],
            )
            at += m
        key = np.empty(n, dtype=np.intp)  # shard numbers across the job: the type bincount and lookups take
        block = BLOCK

        def check(a: int) -> None:  # one block: its checks, its shard numbers
            t, sh = tensor[a : a + block], shard[a : a + block]
            if t.min() < 0 or t.max() >= len(counts) or sh.min() < 0 or np.any(sh >= counts[t]):
                raise PlanningError("a rank reported a need of a tensor or shard this checkpoint does not have")
            key[a : a + block] = first_key[t] + sh * stride[t]  # below counts.sum(): no overflow
            r0, r1 = lo[a : a + block], hi[a : a + block]
            if r0.min() < 0 or np.any(r0 > r1):
                raise PlanningError("a rank reported a need of rows out of order")

        for _ in run(check, range(0, n, block)):
            pass  # the first failing block's error, as in order
        rank = np.repeat(np.arange(world, dtype=np.int32), sizes)
        return cls(tensor, shard, lo, hi, rank, key, int(counts.sum()))


def _numbering(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each tensor's first shard number across the job and the step between its shards'
    numbers (``counts``: shards per tensor): tensors with as many shards as each other are
    numbered shard by shard (shard 0 of each, then shard 1 of each, ...), so that one rank's
    needs, which hold like-numbered shards of many tensors (a sharding's rank-th piece), fall
    close together in the per-shard tables (a tensor by tensor numbering puts them a whole
    tensor's shards apart: a cache miss each)."""
    order = np.argsort(counts, kind="stable")
    c = counts[order]
    heads = np.flatnonzero(np.concatenate([[True], c[1:] != c[:-1]])) if len(c) else np.zeros(0, np.intp)
    size = np.diff(np.append(heads, len(c)))  # tensors per count
    group_base = np.concatenate([[0], np.cumsum(c[heads] * size)])[:-1]
    within = np.arange(len(c)) - np.repeat(heads, size)
    first_key, stride = np.empty(len(c), dtype=np.intp), np.empty(len(c), dtype=np.intp)
    first_key[order] = np.repeat(group_base, size) + within
    stride[order] = np.repeat(size, size)
    return first_key, stride


@dataclass(frozen=True)
class Classified:
    """``classify``'s answer. Per need: ``apart`` (read by its rank for its own rows); per rank:
    ``loads`` (bytes of shards only it needs). The shards several ranks need: two ranks'
    (``pair_first``, ``pair_second``: their needs, in need order) and three or more ranks'
    (groups, in shard order: ``group_first``, each one's first need; ``everyone``: the groups of
    shards every rank needs in overlapping rows (replicated state), whose consumers are all
    ranks and whose needs are not listed; ``members``: the other groups' needs, group after
    group, each in need order, ``listed[g]`` of them for group ``g``); for each, its shard's
    (file, byte offset, byte length) (``pair_where``, ``group_where``) and whether its needs
    are read apart (``pair_apart``, ``group_apart``)."""

    apart: np.ndarray
    loads: np.ndarray
    pair_first: np.ndarray
    pair_second: np.ndarray
    pair_where: tuple[np.ndarray, np.ndarray, np.ndarray]
    pair_apart: np.ndarray
    group_first: np.ndarray
    everyone: np.ndarray
    members: np.ndarray
    listed: np.ndarray
    group_where: tuple[np.ndarray, np.ndarray, np.ndarray]
    group_apart: np.ndarray


def classify(md: Metadata, job: JobNeeds, world: int, extents: Extents, run: Map = map) -> Classified:
    """Counts, alone bytes and the disjoint-rows test (module docstring, step 2). Shard
    geometry is looked up once per shard several ranks need (``ShardLookup.geometry``), and
    only the byte length of a shard one rank needs (``ShardLookup.lengths``). The blocks of
    needs, then the shards of two ranks and those of more, are worked on through ``run`` at
    once (a thread pool's ``map``: numpy's loops release the GIL); each writes only its own
    answer."""
    prepared = _later(run, lambda: ShardLookup(md, job.tensor, BLOCK))  # while the shards are counted
    per_key = np.bincount(job.key, minlength=job.total_keys)
    table = next(prepared)
    split = list(run(lambda a: _split(job, per_key, table, world, a), range(0, len(job), BLOCK)))
    loads = np.sum([x[0] for x in split], axis=0) if split else np.zeros(world)
    pairs, many = (np.concatenate([x[i] for x in split]) if split else np.zeros(0, np.int64) for i in (1, 2))
    del split
    keys = np.flatnonzero(per_key > 2)
    grouped = _later(run, lambda: _groups(table, job, many, keys, world, extents))
    first, second, where_pairs, pair_apart = _pairs(table, job, pairs, extents, run)
    groups = next(grouped)
    apart = np.zeros(len(job), dtype=bool)
    apart[first[pair_apart]] = True
    apart[second[pair_apart]] = True
    first_of, everyone, members, listed, where, group_apart = groups
    apart[members[np.repeat(group_apart, listed)]] = True
    return Classified(
        apart,
        loads.astype(np.int64),
        first,
        second,
        where_pairs,
        pair_apart,
        first_of,
        everyone,
        members,
        listed,
        where,
        group_apart,
    )


def _later(run: Map, task: Callable[[], Any]) -> Iterator[Any]:
    """``task`` started through ``run`` (a pool's ``map`` starts it now; the builtin when its
    result is taken): ``next()`` of the answer is its result."""
    return run(lambda call: call(), [task])


def _split(
    job: JobNeeds, per_key: np.ndarray, table: ShardLookup, world: int, a: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One block of needs from need ``a``: the bytes each rank needs alone there, and the
    needs of shards two ranks need and of those more need."""
    count = per_key[job.key[a : a + BLOCK]]
    alone = np.flatnonzero(count == 1)
    loads: np.ndarray = np.zeros(world)
    if len(alone):
        t, sh = job.tensor[a : a + BLOCK][alone], job.shard[a : a + BLOCK][alone]
        loads = np.bincount(job.rank[a : a + BLOCK][alone], weights=table.lengths(t, sh), minlength=world)
    return loads, np.flatnonzero(count == 2) + a, np.flatnonzero(count > 2) + a


def _pairs(
    table: ShardLookup, job: JobNeeds, pairs: np.ndarray, extents: Extents, run: Map
) -> tuple[np.ndarray, np.ndarray, Where, np.ndarray]:
    """The shards two ranks need (``pairs``: their needs): each one's first and second need,
    its (file, byte offset, byte length), and whether the two read their rows apart (exact,
    vectorised, in blocks through ``run``: temporaries stay small)."""
    first, second = _first_and_last(job.key[pairs], pairs, job.total_keys)
    del pairs
    tensor, shard = job.tensor[first], job.shard[first]
    tables = table.tables(tensor, shard)

    def block(s: int) -> tuple[np.ndarray, ...]:
        at = slice(s, s + BLOCK)
        f, off, length, rb = table.located(tensor[at], shard[at], tables)
        return f, off, length, _apart_pairs(job, first[at], second[at], f, off, rb, extents)

    done = list(run(block, range(0, len(first), BLOCK)))
    if not done:
        return first, second, _nowhere(), np.zeros(0, dtype=bool)
    files, offsets, lengths, pair_apart = (np.concatenate([d[i] for d in done]) for i in range(4))
    return first, second, (files, offsets, lengths), pair_apart


def _nowhere() -> Where:
    """The (file, byte offset, byte length) columns of no shard."""
    empty = np.zeros(0, dtype=np.int64)
    return empty.astype(np.int32), empty, empty


def _apart_pairs(
    job: JobNeeds,
    a: np.ndarray,
    b: np.ndarray,
    f: np.ndarray,
    off: np.ndarray,
    rb: np.ndarray,
    extents: Extents,
) -> np.ndarray:
    """For pairs of needs ``a``, ``b`` of one shard each (its file, byte offset and row bytes):
    whether the two read their rows apart (rows disjoint, and the checksum chunks their reads
    cover overlapping by at most an eighth of what they cover together)."""
    lo, hi = job.lo, job.hi
    swap = (lo[b] < lo[a]) | ((lo[b] == lo[a]) & (hi[b] < hi[a]))  # a, b in row order
    a, b = np.where(swap, b, a), np.where(swap, a, b)
    rows_apart = lo[b] >= hi[a]
    ca = extents(f, off + lo[a] * rb, off + hi[a] * rb)
    cb = extents(f, off + lo[b] * rb, off + hi[b] * rb)
    swap = (cb[0] < ca[0]) | ((cb[0] == ca[0]) & (cb[1] < ca[1]))  # covers in order
    l1, h1 = np.where(swap, cb[0], ca[0]), np.where(swap, cb[1], ca[1])
    l2, h2 = np.where(swap, ca[0], cb[0]), np.where(swap, ca[1], cb[1])
    twice = np.maximum(0, np.minimum(h2, h1) - l2)
    union = np.maximum(0, h1 - l1) + np.maximum(0, h2 - np.maximum(l2, h1))
    return rows_apart & (8 * twice <= union)


def _groups(
    table: ShardLookup, job: JobNeeds, many: np.ndarray, keys: np.ndarray, world: int, extents: Extents
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Where, np.ndarray]:
    """The shards three or more ranks need (``keys``, ascending; ``many``: their needs, in need
    order): each group's first need; which are shards every rank needs in overlapping rows
    (their consumers are all ranks: their needs are not listed); the other groups' needs,
    grouped by shard (members), and how many each group lists; each group's (file, byte
    offset, byte length) and whether its needs are read apart. Per-group sums run over a table of the
    groups (a few per tensor), so only the listed groups' needs are sorted."""
    if not len(keys):
        empty, none = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        return empty, none, empty, empty, _nowhere(), none
    number = np.zeros(job.total_keys, dtype=np.intp)  # a group number per shard
    number[keys] = np.arange(len(keys))
    g = number[job.key[many]]
    del number
    lo, hi = job.lo[many], job.hi[many]
    # rows whose lengths add up past their span overlap (replicated state): only the others are tested
    span_lo = np.full(len(keys), np.iinfo(lo.dtype).max, dtype=lo.dtype)  # types alike: ufunc.at's fast path
    span_hi = np.zeros(len(keys), dtype=hi.dtype)
    np.minimum.at(span_lo, g, lo)
    np.maximum.at(span_hi, g, hi)
    summed = np.bincount(g, weights=(hi - lo).astype(np.float64), minlength=len(keys))
    candidate = summed <= span_hi.astype(np.int64) - span_lo
    first_of = np.full(len(keys), len(job), dtype=np.int64)
    np.minimum.at(first_of, g, many)
    everyone = ~candidate & (np.bincount(g, minlength=len(keys)) == world)
    files, offsets, lengths, row_bytes = table.geometry(job.tensor[first_of], job.shard[first_of])
    # the listed groups' needs: by shard, then need order (stable); a counting sort when the
    # group numbers fit 16 bits
    listed = np.flatnonzero(~everyone[g])
    g, members = g[listed], many[listed]
    order = np.argsort(g.astype(np.uint16) if len(keys) <= 1 << 16 else g, kind="stable")
    members, g = members[order], g[order]
    lo, hi = job.lo[members], job.hi[members]
    listed_count = np.bincount(g, minlength=len(keys))  # 0 for the groups of every rank
    group_apart = np.zeros(len(keys), dtype=bool)
    tested = np.flatnonzero(candidate[g])
    if len(tested):
        tested = tested[np.lexsort((hi[tested], lo[tested], g[tested]))]
        owner = g[tested]  # each tested need's group
        group = np.concatenate([[0], np.cumsum(owner[1:] != owner[:-1])])
        opens = np.concatenate([[True], group[1:] != group[:-1]])
        m_lo, m_hi = lo[tested], hi[tested]
        overlap = ~opens & (m_lo < np.concatenate([[0], m_hi[:-1]]))  # rows meet the previous need's
        rows_apart = np.bincount(group, weights=overlap.astype(np.float64)) == 0
        # the covers in order, per shard: what each covers twice is what it shares with the
        # covers before it (their running end)
        m_off, m_rb = offsets[owner], row_bytes[owner]
        c_lo, c_hi = extents(files[owner], m_off + m_lo * m_rb, m_off + m_hi * m_rb)
        by_cover = np.lexsort((c_hi, c_lo, group))
        c_lo, c_hi = c_lo[by_cover], c_hi[by_cover]
        top = int(c_hi.max()) + 2
        lifted = np.maximum.accumulate(c_hi + group * top)
        end = np.where(opens, -1, np.concatenate([[0], lifted[:-1]]) - group * top)
        twice = np.bincount(group, weights=np.maximum(0, np.minimum(c_hi, end) - c_lo).astype(np.float64))
        union = np.bincount(group, weights=np.maximum(0, c_hi - np.maximum(c_lo, end)).astype(np.float64))
        ok = rows_apart & (8 * twice <= union)
        group_apart[np.unique(owner)[ok]] = True
    return first_of, everyone, members, listed_count, (files, offsets, lengths), group_apart


def _first_and_last(keys: np.ndarray, index: np.ndarray, total_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """For needs ``index`` whose shards two ranks need (``keys``): each need's first and last
    need of its shard (the two, in need order), as need numbers."""
    kind = np.int32 if len(index) and int(index.max()) < 1 << 31 else np.int64  # need numbers
    # each shard's table entry ends up holding one of its two needs (whichever write lands
    # last: numpy does not say, and nothing here depends on it); the other need sees a value
    # not its own, and the pair is (that need, the entry's) in need order
    written = np.empty(total_keys, dtype=kind)
    written[keys] = index
    other = np.flatnonzero(written[keys] != index)
    a, b = index[other], written[keys[other]].astype(index.dtype)
    return np.minimum(a, b), np.maximum(a, b)


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
    found: Classified,
    extents: Extents,
    chunk: int,
    max_batch_bytes: int = 64 << 20,
) -> tuple[list[ColumnBatch], np.ndarray, np.ndarray]:
    """Readers and batches for the shards several ranks need, none read apart:
    the rule (``planning.load.assign``) over them, with ``found.loads`` counted; ``chunk``:
    the checksum chunk (``segment_bytes``). Returns the batches, each batch key's
    representative need (``keys``) and the offsets of the keys in their batches, both in batch
    order."""
    # each shard (any order: file order comes next): its first need and its consumers, ascending
    # (cons[starts[i]:ends[i]]; none listed for a shard every rank needs: ``everyone``); shards
    # of two ranks straight from classify's pairs
    kept = ~found.pair_apart
    pair_a, pair_b = found.pair_first[kept], found.pair_second[kept]
    world = len(found.loads)
    many = found.members[np.repeat(~found.group_apart, found.listed)]  # the kept groups' needs, still grouped
    groups = np.flatnonzero(~found.group_apart)  # the kept groups, in shard order
    if not len(pair_a) and not len(groups):
        return [], np.zeros(0, np.int64), np.zeros(0, np.int64)
    g_width = found.listed[groups]
    rep = np.concatenate([pair_a, found.group_first[groups]])
    cons = np.concatenate([np.stack([job.rank[pair_a], job.rank[pair_b]], axis=1).ravel(), job.rank[many]])
    width = np.concatenate([np.full(len(pair_a), 2, dtype=np.int64), g_width])
    starts = np.cumsum(width) - width
    ends = starts + width
    all_ranks = np.concatenate([np.zeros(len(pair_a), dtype=bool), found.everyone[groups]])
    k_file, k_off, k_len = (np.concatenate([p[kept], g[groups]]) for p, g in zip(found.pair_where, found.group_where))
    segment = segment_bytes(chunk, int(k_len.sum()), len(found.loads))
    # file order; ties by first appearance (the order the rule over Python lists sorts stably)
    by_loc = np.lexsort((rep, k_off, k_file))
    c_lo, c_hi = extents(k_file[by_loc], k_off[by_loc], k_off[by_loc] + k_len[by_loc])
    seg_of = _segments(k_file[by_loc], k_len[by_loc], c_lo, c_hi, segment)
    n_seg = int(seg_of[-1]) + 1
    seg_bytes = np.bincount(seg_of, weights=k_len[by_loc].astype(np.float64), minlength=n_seg).astype(np.int64)
    seg_first = np.flatnonzero(np.concatenate([[True], np.diff(seg_of) != 0]))
    seg_rank = np.lexsort((np.arange(n_seg), k_off[by_loc][seg_first], k_file[by_loc][seg_first], -seg_bytes))
    # each key's consumers again, in file order, so that a segment's are one slice (a segment
    # with a shard every rank needs: all ranks)
    seg_all = np.bincount(seg_of, weights=all_ranks[by_loc], minlength=n_seg) > 0
    w_loc = width[by_loc]
    ptr = np.concatenate([[0], np.cumsum(w_loc)])
    within = np.arange(int(ptr[-1]), dtype=np.int64) - np.repeat(ptr[:-1], w_loc)
    cons_loc = cons[np.repeat(starts[by_loc], w_loc) + within]
    load = found.loads.astype(np.int64).copy()
    reader_of_seg = np.zeros(n_seg, dtype=np.int64)
    seg_end = np.concatenate([seg_first[1:], [len(by_loc)]])
    for seg in seg_rank.tolist():
        if seg_all[seg]:
            r = int(np.argmin(load))  # the least-loaded rank, the lowest on ties
            reader_of_seg[seg] = r
            load[r] += seg_bytes[seg]
            continue
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
    two = (width == 2) & ~all_ranks
    if np.any(all_ranks):
        set_of[all_ranks] = sets.setdefault(tuple(range(world)), len(sets))
    for i in np.flatnonzero(~two & ~all_ranks).tolist():
        set_of[i] = sets.setdefault(tuple(cons[starts[i] : ends[i]].tolist()), len(sets))
    if np.any(two):
        at = starts[two]
        uniq, inv = _factorize(cons[at].astype(np.int64) * (1 << 32) + cons[at + 1])
        ids = [sets.setdefault((int(u) >> 32, int(u) & 0xFFFFFFFF), len(sets)) for u in uniq.tolist()]
        set_of[two] = np.asarray(ids, dtype=np.int64)[inv]
    ranked = sorted(sets, key=lambda t: t)
    set_rank = np.empty(len(sets), dtype=np.int64)
    set_rank[[sets[t] for t in ranked]] = np.arange(len(ranked))
    # (a stable sort of the keys in file order: equal (reader, set) keep file order)
    final = by_loc[np.argsort(reader[by_loc] * len(sets) + set_rank[set_of][by_loc], kind="stable")]
    f_reader, f_set, f_len = reader[final], set_rank[set_of][final], k_len[final]
    group_start = np.flatnonzero(np.concatenate([[True], (np.diff(f_reader) != 0) | (np.diff(f_set) != 0)]))
    group_end = np.concatenate([group_start[1:], [len(final)]])
    aligned = -(-f_len // _ALIGN) * _ALIGN
    pos = np.concatenate([[0], np.cumsum(aligned)])
    reach = pos[:-1] + f_len  # a key fits while (its start in the batch) + its length <= max
    # a group whose last key ends within max_batch_bytes of its start is one batch
    batch_offsets = pos[:-1] - np.repeat(pos[group_start], group_end - group_start)
    whole = (reach[group_end - 1] - pos[group_start] <= max_batch_bytes).tolist()
    batches: list[ColumnBatch] = []
    rows = zip(group_start.tolist(), group_end.tolist(), f_reader[group_start].tolist(), f_set[group_start].tolist())
    for (g0, g1, reader_id, set_id), one in zip(rows, whole):
        consumers = ranked[set_id]
        if one:
            batches.append(ColumnBatch(len(batches), reader_id, consumers, g0, g1, int(pos[g1] - pos[g0])))
            continue
        s = g0
        while s < g1:
            # the first key after s that would end past max_batch_bytes starts the next batch
            e = min(g1, max(s + 1, int(np.searchsorted(reach, pos[s] + max_batch_bytes, side="right"))))
            batch_offsets[s:e] = pos[s:e] - pos[s]
            batches.append(ColumnBatch(len(batches), reader_id, consumers, s, e, int(pos[e] - pos[s])))
            s = e
    return batches, rep[final], batch_offsets


def segment_bytes(chunk: int, shared: int, world: int) -> int:
    """How many bytes of shared shards one reader takes at least (the rule's segment size): a
    quarter of the even share of ``shared`` (the bytes of the shards read once and forwarded,
    each shard once), and at least four checksum chunks; 0 without chunk checksums."""
    if not chunk:
        return 0
    return max(4 * chunk, shared // (4 * max(1, world)))


def _factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)``, sorting only the first value of each run of
    equal neighbours (a job's pairs of consumers come in long runs)."""
    if not len(values):
        return values, np.zeros(0, dtype=np.int64)
    heads = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    uniq, inv = np.unique(values[heads], return_inverse=True)
    return uniq, np.repeat(inv.ravel(), np.diff(np.append(heads, len(values))))


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
    del file_no, prev_end
    prefix = np.concatenate([[0], np.cumsum(lengths)])
    # a segment starting at s ends at the next file change after s, or at the first possible
    # cut (a file change or a candidate) once it holds least bytes: computed for every position
    # a segment can start at (a file change or a candidate), then followed from 0
    changes = np.flatnonzero(new_file)  # ascending, changes[0] == 0
    can_start = np.flatnonzero(candidate | new_file)  # ascending, can_start[0] == 0
    del new_file, candidate
    enough = np.searchsorted(prefix, prefix[can_start] + least, side="left")  # bytes [s, j) >= least
    forced = np.append(changes, n)[np.searchsorted(changes, can_start, side="right")]
    reach = np.append(can_start, n)[np.searchsorted(can_start, np.minimum(np.maximum(enough, can_start + 1), n))]
    # as positions in can_start (len(can_start) for the end): a chase over one list
    following = np.searchsorted(can_start, np.minimum(forced, reach)).tolist()
    cut = []
    i = 0
    while (i := following[i]) < len(can_start):
        cut.append(i)
    seg = np.zeros(n, dtype=np.int64)
    seg[can_start[np.asarray(cut, dtype=np.int64)]] = 1
    return np.cumsum(seg)
