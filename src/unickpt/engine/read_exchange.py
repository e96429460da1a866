"""The exchange of a distributed load's needs: gathered at the coordinator, each rank told only
its own part.

Called by ``read.read_stage`` when reads are deduplicated across ranks (several ranks,
``LoadOptions.dedup_reads`` not False). Order: every rank sends the coordinator (rank 0; up the
tree when the job's coordinator is a tree) its host name and the rows of each saved shard it
needs (``exchange_needs``) -> the coordinator decides once for the job (``read_parts``): on one
host over storage that shares its page cache (``dedup_reads=None``), nothing is forwarded and
each rank learns which of its shards others read too; otherwise shards several ranks need in
disjoint rows are read by each for its own rows (``disjoint_needs``) and every other shard
several ranks need is assigned to one reader (``planning.read_assignment.assign_reads``,
balanced with the bytes each rank reads alone) -> each rank receives only its ``ReadPart``: the
batches of shared shards it reads and those it receives (a received batch names this rank as
its only consumer), its shards read for its own rows, its shards read through the shared
cache; the shards it alone needs it reads itself, unbatched (``own_keys``). A rank's part grows with
its own shared needs (and, for a batch it reads for others, their number), never with the
job's; the coordinator's work is one pass over every need plus the assignment of the shared
ones. A failure at the coordinator reaches every rank as the same error.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from ..coordination.base import Coordinator
from ..errors import CheckpointError, PlanningError
from ..format.dtypes import itemsize
from ..format.layouts import shard_location, shard_row_bytes
from ..format.records import Metadata
from ..planning.load_plan import ShardRead
from ..planning.read_assignment import ReadBatch, ShardKey, assign_reads

__all__ = [
    "ReadPart",
    "NeedsReport",
    "exchange_needs",
    "report_needs",
    "read_parts",
    "own_keys",
    "disjoint_needs",
    "segment_bytes",
]

Rows = tuple[int, int]  # the rows of a saved shard a rank's copies touch
Extent = Callable[[int, int, int], tuple[int, int]]  # (file, lo, hi) -> the bytes a read covers


@dataclass(frozen=True, slots=True)
class ReadPart:
    """One rank's part of a load's reads. ``batches``: the batches of shards other ranks need
    too that it reads (for itself and others) or receives, or None when nothing is forwarded;
    ``apart``: shards others need too, in disjoint rows, that it reads its own rows of;
    ``shared``: shards others read too, through the shared page cache. Every other shard it
    needs, no other rank needs: it reads those itself (``own_keys``)."""

    batches: tuple[ReadBatch, ...] | None
    apart: frozenset[ShardKey] = frozenset()
    shared: frozenset[ShardKey] = frozenset()


def own_keys(rank: int, mine: Iterable[ShardKey], part: ReadPart) -> list[ShardKey]:
    """The shards of ``mine`` that ``part`` leaves to this rank alone (no batch of the
    coordinator holds them, no other rank reads them in disjoint rows), in ``mine``'s order: it
    reads them itself, for itself, so they need no batches (nothing is forwarded)."""
    batches = part.batches or ()
    if not batches and not part.apart:  # nothing taken: every shard (alone, or no exchange)
        return list(mine)
    taken = {k for b in batches if rank in b.consumers for k in b.keys} | part.apart
    return [k for k in mine if k not in taken]


def exchange_needs(
    coord: Coordinator, md: Metadata, reads: Iterable[ShardRead], dedup: bool | None, page_cache: bool, extent: Extent
) -> ReadPart:
    """Collective (the checkpoint group): this rank's ``ReadPart`` (module docstring) for the
    saved shards it needs, ``reads``."""
    needs = [(r.fqn, r.shard_index, *r.rows, r.shard.byte_length) for r in reads]
    gathered = coord.gather_object(report_needs(md, socket.gethostname(), needs))
    parts: list[object] | None = None
    if coord.rank == 0:
        assert gathered is not None
        try:
            parts = list(read_parts(md, gathered, dedup, page_cache, extent))
        except CheckpointError as e:
            parts = [e] * coord.world_size
        except Exception as e:  # every rank gets the same error, none waits for a part
            parts = [PlanningError(f"rank 0 could not assign the reads of this load: {type(e).__name__}: {e}")]
            parts *= coord.world_size
    part = coord.scatter_object(parts)
    if isinstance(part, CheckpointError):
        raise part
    if not isinstance(part, ReadPart):
        raise PlanningError(f"rank {coord.rank} received no part of the load's reads ({type(part).__name__})")
    return part


@dataclass(frozen=True, slots=True)
class NeedsReport:
    """What a rank sends the coordinator: its host name and, per saved shard it needs, one row
    ``[position of the tensor in md.tensors, shard index, first row, end row, shard bytes]``
    (the rows its copies touch; the bytes are what balancing counts) of an (n, 5) int64 array:
    one message of numbers, whatever the tensors' names. Built by ``report_needs``."""

    host: str
    needs: np.ndarray


def report_needs(md: Metadata, host: str, needs: Iterable[tuple[str, int, int, int, int]]) -> NeedsReport:
    """The report of a rank on ``host`` that needs ``(fqn, shard index, first row, end row,
    shard bytes)`` of each saved shard (each shard once)."""
    position = {fqn: i for i, fqn in enumerate(md.tensors)}
    rows = [(position[f], i, lo, hi, n) for f, i, lo, hi, n in needs]
    return NeedsReport(host, np.array(rows, dtype=np.int64).reshape(len(rows), 5))


def read_parts(
    md: Metadata, gathered: list[NeedsReport], dedup: bool | None, page_cache: bool, extent: Extent
) -> list[ReadPart]:
    """Every rank's ``ReadPart`` from every rank's report (the coordinator). Only shards several
    ranks need are assigned here; the bytes each rank reads of the shards it alone needs count
    in the balancing (``assign_reads(loads=...)``), so the readers are those an assignment of
    every need would choose."""
    names = list(md.tensors)
    hosts = {g.host for g in gathered}
    counts = _split(_counts(np.concatenate([g.needs[:, :2] for g in gathered])), [len(g.needs) for g in gathered])
    several = [g.needs[c > 1] for g, c in zip(gathered, counts)]  # the rows of shards other ranks need too
    if dedup is None and len(hosts) == 1 and page_cache:
        # one host reading local files: its page cache already reads each byte from the device
        # once; forwarding pays off across hosts or for remote storage
        return [ReadPart(None, shared=frozenset((names[t], i) for t, i in rows[:, :2].tolist())) for rows in several]
    loads = [int(g.needs[c == 1, 4].sum()) for g, c in zip(gathered, counts)]
    by_rank: list[dict[ShardKey, Rows]] = [
        {(names[t], i): (lo, hi) for t, i, lo, hi, _ in rows.tolist()} for rows in several
    ]
    apart = disjoint_needs(md, by_rank, extent)
    needs = [[k for k in n if k not in apart] for n in by_rank]
    batches = assign_reads(md, needs, cover=extent, segment_bytes=segment_bytes(md, needs), loads=loads)
    mine: list[list[ReadBatch]] = [[] for _ in by_rank]
    for b in batches:
        mine[b.reader].append(b)
        for c in b.consumers:
            if c != b.reader:  # a receiver needs the batch, not the names of the others
                mine[c].append(replace(b, consumers=(c,)))
    return [ReadPart(tuple(m), frozenset(k for k in n if k in apart)) for m, n in zip(mine, by_rank)]


def _counts(keys: np.ndarray) -> np.ndarray:
    """For each row of ``keys`` (an (n, 2) int64 array), how many rows equal it (a sort, then
    the length of each run of equal rows)."""
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((keys[:, 1], keys[:, 0]))
    ordered = keys[order]
    starts = np.ones(len(keys), dtype=bool)
    starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    run = np.cumsum(starts) - 1
    out = np.empty(len(keys), dtype=np.int64)
    out[order] = np.bincount(run)[run]
    return out


def _split(values: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """``values`` cut into consecutive pieces of ``sizes``."""
    return np.split(values, np.cumsum(sizes)[:-1]) if sizes else []


def segment_bytes(md: Metadata, needs: list[list[ShardKey]]) -> int:
    """How many bytes of shared shards one reader takes at least (``assign_reads``): a quarter
    of the even share of the shared bytes, and at least four checksum chunks (so that chunks read
    by two readers at a segment's edges stay a small part)."""
    chunk = getattr(md.checksums, "chunk_size", 0)
    if not chunk:
        return 0
    count: dict[ShardKey, int] = {}
    for n in needs:
        for k in n:
            count[k] = count.get(k, 0) + 1
    shared = sum(md.tensors[k[0]].shards[k[1]].byte_length for k, c in count.items() if c > 1)
    return max(4 * chunk, shared // (4 * max(1, len(needs))))


def disjoint_needs(md: Metadata, by_rank: list[dict[ShardKey, Rows]], extent: Extent) -> set[ShardKey]:
    """Shards several ranks need in different rows, where each rank reading its own rows reads
    few bytes twice: the checksum chunks their reads cover overlap by at most an eighth of what
    they cover together (a resharding load's boundary shards; not small tensors that fit in a
    chunk or two, which are better read once and forwarded)."""
    ranges: dict[ShardKey, list[Rows]] = {}
    for n in by_rank:
        for k, r in n.items():
            ranges.setdefault(k, []).append(r)
    out = set()
    for k, rs in ranges.items():
        if len(rs) < 2:
            continue
        rec = md.tensors[k[0]]
        file_index, offset, _ = shard_location(rec.shards, k[1])
        rb = shard_row_bytes(rec.shards, k[1], itemsize(rec.dtype))
        covers = sorted(extent(file_index, offset + a * rb, offset + b * rb) for a, b in rs)
        union, twice, end = 0, 0, -1
        for lo, hi in covers:
            twice += max(0, min(hi, end) - lo)
            union += max(0, hi - max(lo, end))
            end = max(end, hi)
        if 8 * twice <= union and all(b[0] >= a[1] for a, b in zip(sorted(rs), sorted(rs)[1:])):
            out.add(k)
    return out
