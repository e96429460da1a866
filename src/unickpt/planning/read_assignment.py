"""Zero-redundancy read assignment for a distributed load (pure functions).

Every rank computes, from the same inputs (every rank's list of needed saved shards, gathered
once), the same assignment: each needed shard is read from storage by exactly one rank, balanced
by bytes (shards needed by one rank go to it; shared ones, in *segments*, largest first, to the
least-loaded rank among the segment's consumers), and shards with the same reader and consumer
set are grouped into batches of at most ``max_batch_bytes`` that the reader sends to the other
consumers as one message. Called by each rank for the shards it alone needs
(``engine.read_exchange.own_batches``); the coordinator applies the same rule to a whole job's
needs in columns (``planning.read_columns``), and tests check the two agree.

Segments: shared shards are read in whole checksum units (``format.checksums``: file chunks from
format version 3), so two readers of neighbouring small shards would both read the chunk they
share. Shared shards are therefore taken in file order and cut into segments of at least
``segment_bytes``, only where no unit straddles the cut (``cover`` says which bytes a read of a
shard covers); each segment has one reader. With ``segment_bytes`` 0 and per-shard units
(format versions 1 and 2) every shard is its own segment.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..format.layouts import shard_location
from ..format.records import Metadata

__all__ = ["ShardKey", "ReadBatch", "assign_reads"]

ShardKey = tuple[str, int]  # (fqn, index into TensorRecord.shards)
_ALIGN = 64


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


Cover = Callable[[int, int, int], tuple[int, int]]  # (file, lo, hi) -> the bytes a read of [lo, hi) covers


def assign_reads(
    md: Metadata,
    needs: list[list[ShardKey]],
    max_batch_bytes: int = 64 << 20,
    cover: Cover | None = None,
    segment_bytes: int = 0,
    loads: list[int] | None = None,
) -> list[ReadBatch]:
    """Batches covering every needed shard exactly once, in a deterministic order. ``loads``:
    bytes each rank reads already (shards it alone needs, assigned elsewhere), counted by the
    balancing as if they were among ``needs``."""
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
        return where[k][:2]

    load = list(loads) if loads is not None else [0] * len(needs)
    reader: dict[ShardKey, int] = {}
    for k, cs in consumers.items():
        if len(cs) == 1:
            reader[k] = cs[0]
            load[cs[0]] += size(k)
    segments = _segments(
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


def _segments(
    where: dict[ShardKey, tuple[int, int, int]], keys: list[ShardKey], cover: Cover | None, segment_bytes: int
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
