"""Who reads which saved shard in a distributed load (the read assignment), decided once for the
job by the coordinator from every rank's needs.

The rule: each needed shard is read from storage by exactly one rank, balanced by bytes (shards
needed by one rank go to it; shared ones, in *segments*, largest first, to the least-loaded rank
among the segment's consumers), and shards with the same reader and consumer set are grouped into
batches of at most ``max_batch_bytes`` that the reader sends to the other consumers as one
message. Segments: shared shards are read in whole checksum units (``format.checksums``: file
chunks from format version 3), so two readers of neighbouring small shards would both read the
chunk they share; shared shards are therefore taken in file order and cut into segments of at
least ``segment_bytes``, only where no unit straddles the cut; each segment has one reader.
Shards several ranks need in disjoint rows (a resharding load to another world size) are not
assigned: each rank reads its own rows (``apart``). On one host over storage that shares its
page cache (``dedup=None``), nothing is forwarded: each rank learns which of its shards others
read too (``shared``).

Two versions of one rule:

* :func:`plain_parts` (with :func:`plain_batches`, :func:`plain_disjoint`): the rule written
  plainly over Python lists and dicts, the spec. The tests check the columnar version against it.
* :func:`assign_reads`: what the coordinator runs (``engine.load.exchange``), every pass over the
  needs vectorised (``planning.load._columns``), so that a whole-job reshard of thousands of
  ranks (millions of needs) costs numpy passes plus a Python step per segment and batch. It
  takes each rank's report (``report_needs``: one ``NEED_DTYPE`` row of 24 bytes per need) and
  returns each rank's part as sent (``PartWire``), which the rank decodes (``decode_part``) into
  its :class:`ReadPart`. A rank's part grows with its own shared needs (and, for a batch it reads
  for others, their number), never with the job's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ...errors import PlanningError
from ...format.dtypes import itemsize
from ...format.layouts import shard_location, shard_row_bytes
from ...format.records import Metadata
from ._columns import NEED_DTYPE, JobNeeds, Map, assign_columns, classify
from .runs import Extent, Extents

__all__ = [
    "ShardKey",
    "ReadBatch",
    "ReadPart",
    "NEED_DTYPE",
    "Map",
    "Report",
    "PartWire",
    "assign_reads",
    "report_needs",
    "decode_part",
    "own_keys",
    "plain_parts",
    "plain_batches",
    "plain_disjoint",
]

ShardKey = tuple[str, int]  # (fqn, index into TensorRecord.shards)
Rows = tuple[int, int]  # the rows of a saved shard a rank's copies touch
_ALIGN = 64  # batch offsets


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """Shards ``keys`` read by ``reader`` into one buffer (at ``offsets``), sent to ``consumers``."""

    batch_id: int
    reader: int
    consumers: tuple[int, ...]  # every rank that needs these shards (may include the reader, or not)
    keys: tuple[ShardKey, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def forwarded(self) -> bool:
        """Whether the reader sends these shards to other ranks."""
        return any(c != self.reader for c in self.consumers)


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


# --------------------------------------------------------------------------- the coordinator's


Report = tuple[str, bytes]  # host, the rank's needs (report_needs)
# a rank's part as sent: the batches (id, reader, consumers, keys as int32 (tensor, shard)
# pairs, offsets as int64, bytes) or None, then bit masks over the rank's needs: read apart,
# read through the shared page cache
PartWire = tuple[list[tuple[int, int, tuple[int, ...], bytes, bytes, int]] | None, bytes, bytes]


def report_needs(md: Metadata, rows: dict[ShardKey, Rows], names: list[str] | None = None) -> bytes:
    """What a rank sends the coordinator: one ``NEED_DTYPE`` row per saved shard it needs (the
    tensor's number in the metadata's order, the shard, the rows its copies touch), in the order
    of ``rows`` (the order the answer's masks follow)."""
    number = {n: i for i, n in enumerate(names if names is not None else md.tensors)}
    out = np.empty(len(rows), dtype=NEED_DTYPE)
    if rows:
        out["tensor"] = [number[f] for f, _ in rows]
        out["shard"] = [i for _, i in rows]
        lo_hi = np.asarray(list(rows.values()), dtype=np.int64).reshape(-1, 2)
        out["lo"], out["hi"] = lo_hi[:, 0], lo_hi[:, 1]
    return out.tobytes()


def assign_reads(
    md: Metadata,
    gathered: list[Report],
    dedup: bool | None,
    page_cache: bool,
    extents: Extents,
    max_batch_bytes: int = 64 << 20,
    run: Map = map,
) -> list[PartWire]:
    """Every rank's part from every rank's report (the rule of the module docstring, columnar).
    Only shards several ranks need are assigned here; the bytes each rank reads of the shards
    it alone needs count in the balancing, so the readers are those an assignment of every need
    would choose. ``run``: how the passes over blocks of needs are run (``map``-like; the engine
    passes a thread pool's, as numpy's loops release the GIL)."""
    world = len(gathered)
    per_rank = []
    for r, (_, blob) in enumerate(gathered):
        if not isinstance(blob, bytes) or len(blob) % NEED_DTYPE.itemsize:
            raise PlanningError(f"rank {r} sent the coordinator a report of its needs that is not whole rows")
        per_rank.append(np.frombuffer(blob, dtype=NEED_DTYPE))
    job = JobNeeds.of(md, per_rank, run)
    bounds = np.concatenate([[0], np.cumsum([len(n) for n in per_rank])])
    total_keys = job.total_keys

    def masks(mask: np.ndarray) -> list[bytes]:
        return [np.packbits(mask[bounds[r] : bounds[r + 1]]).tobytes() for r in range(world)]

    hosts = {h for h, _ in gathered}
    if dedup is None and len(hosts) == 1 and page_cache:
        # one host reading local files: its page cache already reads each byte from the device
        # once; forwarding pays off across hosts or for remote storage
        count = np.bincount(job.key, minlength=total_keys)[job.key]
        return [(None, b"", m) for m in masks(count > 1)]
    found = classify(md, job, world, extents, run)
    chunk = getattr(md.checksums, "chunk_size", 0)
    batches, keys, offsets = assign_columns(job, found, extents, chunk, max_batch_bytes)
    pairs = np.empty((len(keys), 2), dtype="<i4")
    pairs[:, 0], pairs[:, 1] = job.tensor[keys], job.shard[keys]
    mine: list[list[tuple[int, int, tuple[int, ...], bytes, bytes, int]]] = [[] for _ in range(world)]
    for b in batches:
        k, o = pairs[b.start : b.end].tobytes(), offsets[b.start : b.end].astype("<i8").tobytes()
        mine[b.reader].append((b.batch_id, b.reader, b.consumers, k, o, b.nbytes))
        for c in b.consumers:
            if c != b.reader:  # a receiver needs the batch, not the names of the others
                mine[c].append((b.batch_id, b.reader, (c,), k, o, b.nbytes))
    return [(m, a, b"") for m, a in zip(mine, masks(found.apart))]


def decode_part(wire: object, names: list[str], keys: list[ShardKey], rank: int) -> ReadPart:
    """A rank's ``ReadPart`` from what the coordinator sent it (``assign_reads``); ``keys``: the
    shards it reported, in its report's order."""
    try:
        if not isinstance(wire, tuple) or len(wire) != 3:
            raise TypeError(f"a {type(wire).__name__}, not a part")
        batches_wire, apart_bits, shared_bits = wire
        apart = np.unpackbits(np.frombuffer(apart_bits, dtype=np.uint8), count=len(keys)) if apart_bits else None
        shared = np.unpackbits(np.frombuffer(shared_bits, dtype=np.uint8), count=len(keys)) if shared_bits else None
        batches = None
        if batches_wire is not None:
            batches = []
            for batch_id, reader, consumers, k, o, nbytes in batches_wire:
                pairs = np.frombuffer(k, dtype="<i4").reshape(-1, 2).tolist()
                batch_keys = tuple((names[t], i) for t, i in pairs)
                offs = tuple(np.frombuffer(o, dtype="<i8").tolist())
                batches.append(ReadBatch(batch_id, reader, tuple(consumers), batch_keys, offs, nbytes))
    except (TypeError, ValueError, IndexError) as e:
        raise PlanningError(f"rank {rank} received no usable part of the load's reads ({type(e).__name__}: {e})") from e

    def chosen(bits: np.ndarray | None) -> frozenset[ShardKey]:
        return frozenset() if bits is None else frozenset(k for k, on in zip(keys, bits.tolist()) if on)

    return ReadPart(None if batches is None else tuple(batches), chosen(apart), chosen(shared))


# --------------------------------------------------------------------------- the rule, plainly


def plain_parts(
    md: Metadata,
    by_rank: Sequence[dict[ShardKey, Rows]],
    hosts: Sequence[str],
    dedup: bool | None,
    page_cache: bool,
    extent: Extent,
    max_batch_bytes: int = 64 << 20,
) -> list[tuple[tuple[ReadBatch, ...] | None, frozenset[ShardKey], frozenset[ShardKey]]]:
    """The spec of ``assign_reads``: each rank's (batches or None, apart keys, shared-cache keys)
    from every rank's needs (``by_rank[r]``: {shard key: rows}, in report order), as
    ``decode_part`` gives them from ``assign_reads``' answer."""
    count: dict[ShardKey, int] = {}
    for n in by_rank:
        for k in n:
            count[k] = count.get(k, 0) + 1
    if dedup is None and len(set(hosts)) == 1 and page_cache:
        return [(None, frozenset(), frozenset(k for k in n if count[k] > 1)) for n in by_rank]
    loads = [0] * len(by_rank)
    several: list[dict[ShardKey, Rows]] = []
    for r, n in enumerate(by_rank):
        mine = {}
        for k, rows in n.items():
            if count[k] > 1:
                mine[k] = rows
            else:
                loads[r] += shard_location(md.tensors[k[0]].shards, k[1])[2]
        several.append(mine)
    apart = plain_disjoint(md, several, extent)
    needs = [[k for k in n if k not in apart] for n in several]
    chunk = getattr(md.checksums, "chunk_size", 0)
    least = 0
    if chunk:
        shared = {k for n in needs for k in n}
        nbytes = sum(shard_location(md.tensors[k[0]].shards, k[1])[2] for k in shared)
        least = max(4 * chunk, nbytes // (4 * max(1, len(needs))))
    batches = plain_batches(md, needs, max_batch_bytes, cover=extent, segment_bytes=least, loads=loads)
    mine_batches: list[list[ReadBatch]] = [[] for _ in by_rank]
    for b in batches:
        mine_batches[b.reader].append(b)
        for c in b.consumers:
            if c != b.reader:
                mine_batches[c].append(replace(b, consumers=(c,)))
    return [(tuple(m), frozenset(k for k in n if k in apart), frozenset()) for m, n in zip(mine_batches, several)]


def plain_disjoint(md: Metadata, by_rank: Sequence[dict[ShardKey, Rows]], extent: Extent) -> set[ShardKey]:
    """Shards several ranks need in pairwise disjoint rows whose reads' checksum chunks overlap
    by at most an eighth of what they cover together: each of those ranks reads its own rows."""
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


def plain_batches(
    md: Metadata,
    needs: list[list[ShardKey]],
    max_batch_bytes: int = 64 << 20,
    cover: Extent | None = None,
    segment_bytes: int = 0,
    loads: list[int] | None = None,
) -> list[ReadBatch]:
    """Batches covering every needed shard exactly once, in a deterministic order: every needed
    shard read once, by one of its consumers, balanced by bytes, in chunk-aligned segments,
    batched per (reader, consumers). ``loads``: bytes each rank reads already (shards it alone
    needs, assigned elsewhere), counted by the balancing as if they were among ``needs``."""
    consumers: dict[ShardKey, list[int]] = defaultdict(list)
    for rank, keys in enumerate(needs):
        for k in dict.fromkeys(keys):
            consumers[k].append(rank)

    tensors = md.tensors
    where = {}  # key -> (file index, byte offset, byte length), looked up once
    for k in consumers:
        where[k] = shard_location(tensors[k[0]].shards, k[1])

    def size(k: ShardKey) -> int:
        return where[k][2]

    def location(k: ShardKey) -> tuple[int, int]:
        return where[k][0], where[k][1]

    load = list(loads) if loads is not None else [0] * len(needs)
    reader: dict[ShardKey, int] = {}
    for k, cs in consumers.items():
        if len(cs) == 1:
            reader[k] = cs[0]
            load[cs[0]] += size(k)
    segments = _plain_segments(
        where, sorted((k for k, cs in consumers.items() if len(cs) > 1), key=location), cover, segment_bytes
    )
    segments.sort(key=lambda seg: (-sum(size(k) for k in seg), location(seg[0])))
    for seg in segments:
        r = min({c for k in seg for c in consumers[k]}, key=lambda c: (load[c], c))
        for k in seg:
            reader[k] = r
            load[r] += size(k)

    groups: dict[tuple[int, tuple[int, ...]], list[ShardKey]] = defaultdict(list)
    for k in sorted(reader, key=location):
        groups[(reader[k], tuple(consumers[k]))].append(k)
    batches: list[ReadBatch] = []
    for (r, cons), keys in sorted(groups.items()):
        cur: list[ShardKey] = []
        offs: list[int] = []
        pos = 0
        for k in keys:
            n = size(k)
            if cur and pos + n > max_batch_bytes:
                batches.append(ReadBatch(len(batches), r, cons, tuple(cur), tuple(offs), pos))
                cur, offs, pos = [], [], 0
            cur.append(k)
            offs.append(pos)
            pos += -(-n // _ALIGN) * _ALIGN
        if cur:
            batches.append(ReadBatch(len(batches), r, cons, tuple(cur), tuple(offs), pos))
    return batches


def _plain_segments(
    where: dict[ShardKey, tuple[int, int, int]], keys: list[ShardKey], cover: Extent | None, segment_bytes: int
) -> list[list[ShardKey]]:
    """``keys`` (in file order) cut into runs of one file of at least ``segment_bytes`` bytes,
    cut only where the next shard's covered bytes start after the current run's end
    (``where``: each key's file index, byte offset and byte length)."""
    out: list[list[ShardKey]] = []
    cur: list[ShardKey] = []
    cur_file, cur_bytes, cur_end = -1, 0, 0
    for k in keys:
        file_index, offset, length = where[k]
        end = offset + length
        lo, hi = cover(file_index, offset, end) if cover is not None else (offset, end)
        if cur and (file_index != cur_file or (cur_bytes >= segment_bytes and lo >= cur_end)):
            out.append(cur)
            cur, cur_bytes, cur_end = [], 0, 0
        cur.append(k)
        cur_file, cur_bytes, cur_end = file_index, cur_bytes + length, max(cur_end, hi)
    if cur:
        out.append(cur)
    return out
