"""The exchange of a distributed load's needs: gathered at the coordinator, each rank told only
its own part.

Called by ``read.read_stage`` when reads are deduplicated across ranks (several ranks,
``LoadOptions.dedup_reads`` not False). Order: every rank sends the coordinator (rank 0; up the
tree when the job's coordinator is a tree) its host name and the rows of each saved shard it
needs (``exchange_needs``) -> the coordinator decides once for the job (``read_parts``): on one
host over storage that shares its page cache (``dedup_reads=None``), nothing is forwarded and
each rank learns which of its shards others read too; otherwise shards several ranks need in
disjoint rows are read by each for its own rows (``disjoint_needs``) and every other needed
shard is assigned to one reader (``planning.read_assignment.assign_reads``) -> each rank
receives only its ``ReadPart``: the batches it reads and those it receives (a received batch
names this rank as its only consumer), its shards read for its own rows, its shards read
through the shared cache. A rank's part grows with its own needs (and, for a batch it reads for
others, their number), never with the job's; the coordinator's work is the job's. A failure at
the coordinator reaches every rank as the same error.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..coordination.base import Coordinator
from ..errors import CheckpointError, PlanningError
from ..format.dtypes import itemsize
from ..format.records import Metadata
from ..planning.byte_runs import row_bytes
from ..planning.read_assignment import ReadBatch, ShardKey, assign_reads

__all__ = ["ReadPart", "exchange_needs", "read_parts", "disjoint_needs", "segment_bytes"]

Rows = tuple[int, int]  # the rows of a saved shard a rank's copies touch
Extent = Callable[[int, int, int], tuple[int, int]]  # (file, lo, hi) -> the bytes a read covers


@dataclass(frozen=True, slots=True)
class ReadPart:
    """One rank's part of a load's reads. ``batches``: those it reads (for itself and others)
    and those it receives, or None when nothing is forwarded (it assigns its own shards to
    itself); ``apart``: shards others need too, in disjoint rows, that it reads its own rows
    of; ``shared``: shards others read too, through the shared page cache."""

    batches: tuple[ReadBatch, ...] | None
    apart: frozenset[ShardKey] = frozenset()
    shared: frozenset[ShardKey] = frozenset()


def exchange_needs(
    coord: Coordinator, md: Metadata, rows: dict[ShardKey, Rows], dedup: bool | None, page_cache: bool, extent: Extent
) -> ReadPart:
    """Collective (the checkpoint group): this rank's ``ReadPart`` (module docstring)."""
    report = (socket.gethostname(), [(*k, *r) for k, r in rows.items()])
    gathered = coord.gather_object(report)
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


def read_parts(
    md: Metadata,
    gathered: list[tuple[str, list[tuple[str, int, int, int]]]],
    dedup: bool | None,
    page_cache: bool,
    extent: Extent,
) -> list[ReadPart]:
    """Every rank's ``ReadPart`` from every rank's (host, needs) report (the coordinator)."""
    hosts = {h for h, _ in gathered}
    by_rank = [{(f, i): (a, b) for f, i, a, b in n} for _, n in gathered]
    if dedup is None and len(hosts) == 1 and page_cache:
        # one host reading local files: its page cache already reads each byte from the device
        # once; forwarding pays off across hosts or for remote storage
        count: dict[ShardKey, int] = {}
        for n in by_rank:
            for k in n:
                count[k] = count.get(k, 0) + 1
        return [ReadPart(None, shared=frozenset(k for k in n if count[k] > 1)) for n in by_rank]
    apart = disjoint_needs(md, by_rank, extent)
    needs = [[k for k in n if k not in apart] for n in by_rank]
    batches = assign_reads(md, needs, cover=extent, segment_bytes=segment_bytes(md, needs))
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
        shard = rec.shards[k[1]]
        rb = row_bytes(shard.lengths, itemsize(rec.dtype))
        covers = sorted(extent(shard.file_index, shard.byte_offset + a * rb, shard.byte_offset + b * rb) for a, b in rs)
        union, twice, end = 0, 0, -1
        for lo, hi in covers:
            twice += max(0, min(hi, end) - lo)
            union += max(0, hi - max(lo, end))
            end = max(end, hi)
        if 8 * twice <= union and all(b[0] >= a[1] for a, b in zip(sorted(rs), sorted(rs)[1:])):
            out.add(k)
    return out
