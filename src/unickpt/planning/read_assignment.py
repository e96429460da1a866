"""The records of a distributed load's read assignment: ``ShardKey`` and ``ReadBatch``.

The rule (``planning.read_columns``, applied by the coordinator to every rank's needs): each
needed shard is read from storage by exactly one rank, balanced by bytes (shards needed by one
rank go to it; shared ones, in *segments*, largest first, to the least-loaded rank among the
segment's consumers), and shards with the same reader and consumer set are grouped into
batches of at most ``max_batch_bytes`` that the reader sends to the other consumers as one
message. Segments: shared shards are read in whole checksum units (``format.checksums``: file
chunks from format version 3), so two readers of neighbouring small shards would both read the
chunk they share; shared shards are therefore taken in file order and cut into segments of at
least ``segment_bytes``, only where no unit straddles the cut; each segment has one reader.
The tests keep the rule written plainly over Python lists (``tests/read_fixtures.py``) and
check the columnar one against it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardKey", "ReadBatch"]

ShardKey = tuple[str, int]  # (fqn, index into TensorRecord.shards)


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
