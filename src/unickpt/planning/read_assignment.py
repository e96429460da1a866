"""Zero-redundancy read assignment for a distributed load (pure functions).

Every rank computes, from the same inputs (every rank's list of needed saved shards, gathered
once), the same assignment: each needed shard is read from storage by exactly one of the ranks
that need it, balanced by bytes (shards needed by one rank go to it; shared ones, largest
first, to the least-loaded of their consumers), and shards with the same reader and consumer set
are grouped into batches of at most ``max_batch_bytes`` that the reader sends to the other
consumers as one message. Called by ``engine.read`` after ``plan_local_load``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..format.records import Metadata

__all__ = ["ShardKey", "ReadBatch", "assign_reads"]

ShardKey = tuple[str, int]  # (fqn, index into TensorRecord.shards)
_ALIGN = 64


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """Shards ``keys`` read by ``reader`` into one buffer (at ``offsets``), sent to ``consumers``."""

    batch_id: int
    reader: int
    consumers: tuple[int, ...]  # every rank that needs these shards (may include the reader)
    keys: tuple[ShardKey, ...]
    offsets: tuple[int, ...]
    nbytes: int


def assign_reads(md: Metadata, needs: list[list[ShardKey]], max_batch_bytes: int = 64 << 20) -> list[ReadBatch]:
    """Batches covering every needed shard exactly once, in a deterministic order."""
    consumers: dict[ShardKey, list[int]] = defaultdict(list)
    for rank, keys in enumerate(needs):
        for k in dict.fromkeys(keys):
            consumers[k].append(rank)

    def size(k: ShardKey) -> int:
        return md.tensors[k[0]].shards[k[1]].byte_length

    def location(k: ShardKey) -> tuple[int, int]:
        s = md.tensors[k[0]].shards[k[1]]
        return (s.file_index, s.byte_offset)

    load = [0] * len(needs)
    reader: dict[ShardKey, int] = {}
    for k, cs in consumers.items():
        if len(cs) == 1:
            reader[k] = cs[0]
            load[cs[0]] += size(k)
    shared = sorted((k for k, cs in consumers.items() if len(cs) > 1), key=lambda k: (-size(k), location(k)))
    for k in shared:
        r = min(consumers[k], key=lambda c: (load[c], c))
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
