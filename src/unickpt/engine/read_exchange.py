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

from ..coordination.base import Coordinator
from ..errors import CheckpointError, PlanningError
from ..format.dtypes import itemsize
from ..format.layouts import shard_location, shard_row_bytes
from ..format.records import Metadata
from ..planning.load_plan import ShardRead
from ..planning.read_assignment import ReadBatch, ShardKey, assign_reads

__all__ = [
    "ReadPart",
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
    gathered = coord.gather_object((socket.gethostname(), report_needs(reads)))
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


def report_needs(reads: Iterable[ShardRead]) -> list[tuple[str, int, int, int, int]]:
    """What a rank sends the coordinator of each saved shard it needs: its key, the rows its
    copies touch, and the shard's bytes (what balancing counts)."""
    return [(r.fqn, r.shard_index, *r.rows, r.shard.byte_length) for r in reads]


Report = tuple[str, list[tuple[str, int, int, int, int]]]  # host, [(fqn, shard, row lo, row hi, bytes)]


def read_parts(
    md: Metadata, gathered: list[Report], dedup: bool | None, page_cache: bool, extent: Extent
) -> list[ReadPart]:
    """Every rank's ``ReadPart`` from every rank's report (the coordinator). Only shards several
    ranks need are assigned here; the bytes each rank reads of the shards it alone needs count
    in the balancing (``assign_reads(loads=...)``), so the readers are those an assignment of
    every need would choose."""
    hosts = {h for h, _ in gathered}
    count: dict[ShardKey, int] = {}
    for _, n in gathered:
        for f, i, *_ in n:
            k = (f, i)
            count[k] = count.get(k, 0) + 1
    if dedup is None and len(hosts) == 1 and page_cache:
        # one host reading local files: its page cache already reads each byte from the device
        # once; forwarding pays off across hosts or for remote storage
        return [ReadPart(None, shared=frozenset((f, i) for f, i, *_ in n if count[(f, i)] > 1)) for _, n in gathered]
    loads = [0] * len(gathered)
    by_rank: list[dict[ShardKey, Rows]] = []
    for r, (_, n) in enumerate(gathered):
        several = {}
        for f, i, lo, hi, nbytes in n:
            if count[(f, i)] > 1:
                several[(f, i)] = (lo, hi)
            else:
                loads[r] += nbytes
        by_rank.append(several)
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
