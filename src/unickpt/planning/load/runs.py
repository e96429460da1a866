"""Which bytes a rank reads and how (pure functions): the part of each saved shard it needs,
where those bytes land (``place_need``: direct, forwarded or small), and the byte spans grouped
into runs, each run one contiguous stretch of one file that starts and ends on the checksum units
covering it (``format.checksums``: ``extent_of``, ``extents_of``, ``cover_of``).

Used on every rank after the read assignment (the read stage, ``engine.load.stage``):
``needed_rows`` for each saved shard this rank reads only for itself (it needs the rows its copies
touch, not the whole shard: a resharding load to another world size reads a part of each boundary
shard), then ``place_need`` for each need, then ``plan_runs`` over all spans of the rank. Two
spans whose covering units overlap go into one run (a unit is read and verified once); spans
closer than ``merge_gap`` bytes too (one read instead of many for small tensors saved next to each
other).

Why rows: a saved box is stored row-major, so the rows ``[r0, r1)`` of its first dimension are
one contiguous byte range; a copy out of the box touches the rows of its own first-dimension
range. For row splits (FSDP ``Shard(0)``, TP column-parallel weights) that is exactly the bytes
needed; for column splits the rows span most of the box.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from ...format.checksums import ChunkChecksums, Units
from ...format.dtypes import itemsize
from ...format.records import Metadata, ShardRecord
from ..specs import Shape

__all__ = [
    "Span",
    "Run",
    "needed_rows",
    "row_bytes",
    "plan_runs",
    "MERGE_GAP",
    "DIRECT_MIN",
    "Placement",
    "Placed",
    "place_need",
    "whole_shard",
    "Extent",
    "Extents",
    "extent_of",
    "extents_of",
    "cover_of",
    "vectorized",
]

MERGE_GAP = 4096  # spans whose covers are at most this far apart are read as one (alignment padding)
DIRECT_MIN = 256 << 10  # needs at least this large are read straight into their destination
Extent = Callable[[int, int, int], tuple[int, int]]  # (file, lo, hi) -> the bytes a read of [lo, hi) covers
Extents = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # Extent over arrays


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes ``[lo, hi)`` of file ``file_index`` that one need of this rank reads; ``tag``: the
    caller's index of that need."""

    file_index: int
    lo: int
    hi: int
    tag: int


@dataclass(frozen=True, slots=True)
class Run:
    """One read: bytes ``[lo, hi)`` of file ``file_index`` (the covering units of its spans,
    gaps included), serving the spans ``tags`` (in file order)."""

    file_index: int
    lo: int
    hi: int
    tags: tuple[int, ...]


def row_bytes(lengths: Shape, itemsize: int) -> int:
    """Bytes of one row (one index of the first dimension) of a box; a 0-d box is one row."""
    return math.prod(lengths[1:]) * itemsize if lengths else itemsize


def needed_rows(lengths: Shape, copies: Sequence[tuple[Shape, Shape]]) -> tuple[int, int]:
    """The rows ``[r0, r1)`` of a saved box of ``lengths`` that copies out of it touch (``copies``:
    each one's ``(src_offsets, lengths)`` relative to the box); ``(0, 1)`` for a 0-d box."""
    if not lengths:
        return (0, 1)
    touched = [(o[0], o[0] + n[0]) for o, n in copies if n and n[0] > 0 and all(n)]
    if not touched:
        return (0, 0)
    return (min(a for a, _ in touched), max(b for _, b in touched))


def plan_runs(
    spans: Sequence[Span], cover: Callable[[int, int, int], tuple[int, int]], merge_gap: int = MERGE_GAP
) -> list[Run]:
    """Group ``spans`` into runs, in (file, offset) order. ``cover(file, lo, hi)``: the byte range
    to read to verify ``[lo, hi)`` (the units covering it); a span's run reads at least that.
    Empty spans get a run of their own (nothing read: they are only placed)."""
    out: list[Run] = []
    cur: list[int] = []
    cf, clo, chi = -1, 0, 0
    for s in sorted(spans, key=lambda s: (s.file_index, s.lo, s.hi, s.tag)):
        if s.hi <= s.lo:
            out.append(Run(s.file_index, s.lo, s.lo, (s.tag,)))
            continue
        lo, hi = cover(s.file_index, s.lo, s.hi)
        lo, hi = min(lo, s.lo), max(hi, s.hi)
        if cur and s.file_index == cf and lo <= chi + merge_gap:
            cur.append(s.tag)
            chi = max(chi, hi)
            continue
        if cur:
            out.append(Run(cf, clo, chi, tuple(cur)))
        cur, cf, clo, chi = [s.tag], s.file_index, lo, hi
    if cur:
        out.append(Run(cf, clo, chi, tuple(cur)))
    return out


class Placement(Enum):
    """Where the bytes of one need land (``place_need``)."""

    FORWARDED = "forwarded"  # the whole shard, into the buffer its batch is forwarded from
    DIRECT = "direct"  # large: straight into its destination where that is one contiguous region
    SMALL = "small"  # small: read with its neighbours into one temporary, then copied


@dataclass(frozen=True, slots=True)
class Placed:
    """What a rank reads of one saved shard: rows ``[r0, r1)`` of its box, bytes ``[lo, hi)`` of
    file ``file_index``, landing as ``placement`` says."""

    file_index: int
    r0: int
    r1: int
    lo: int
    hi: int
    placement: Placement


def whole_shard(md: Metadata, fqn: str, shard_index: int) -> tuple[ShardRecord, int]:
    """The record and row bytes of a saved shard this rank reads for others only."""
    rec = md.tensors[fqn]
    shard = rec.shards[shard_index]
    return shard, row_bytes(shard.lengths, itemsize(rec.dtype))


def place_need(shard: ShardRecord, row_bytes: int, rows: tuple[int, int] | None, forwarded: bool) -> Placed:
    """The bytes this rank reads of saved ``shard`` (``row_bytes`` a row) and where they land: the
    whole shard when it is ``forwarded`` to other ranks (into the batch's buffer) or read for
    others only (``rows`` None: this rank's copies touch none of it); else only the ``rows`` its
    copies touch, straight into the destination when at least ``DIRECT_MIN`` bytes (the engine
    reads into a temporary where the destination is not one contiguous region), else with its
    small neighbours (``engine.load.reader``'s groups)."""
    if forwarded or rows is None:
        r0, r1 = 0, (shard.lengths[0] if shard.lengths else 1)
    else:
        r0, r1 = rows
    lo, hi = shard.byte_offset + r0 * row_bytes, shard.byte_offset + r1 * row_bytes
    if forwarded:
        placement = Placement.FORWARDED
    elif hi - lo >= DIRECT_MIN:
        placement = Placement.DIRECT
    else:
        placement = Placement.SMALL
    return Placed(shard.file_index, r0, r1, lo, hi, placement)


def extent_of(md: Metadata, verify: bool) -> Extent:
    """The bytes a read of ``[lo, hi)`` of a file covers (its checksum units)."""
    if verify and isinstance(md.checksums, ChunkChecksums):
        return md.checksums.extent  # chunk arithmetic, no unit list
    cover = cover_of(md, verify)

    def extent(f: int, lo: int, hi: int) -> tuple[int, int]:
        units = cover(f, lo, hi)
        return units.lo, units.hi

    return extent


def extents_of(md: Metadata, verify: bool) -> Extents:
    """``extent_of`` over arrays (the coordinator's read assignment): the chunk checksums' own
    vectorised arithmetic, else ``extent_of`` one range at a time."""
    if verify and isinstance(md.checksums, ChunkChecksums):
        return md.checksums.extents
    return vectorized(extent_of(md, verify))


def cover_of(md: Metadata, verify: bool) -> Callable[[int, int, int], Units]:
    """The checksum units covering a byte range (none when not verifying, or for metadata
    without checksums: then exactly the range is read)."""
    sums = md.checksums
    if not verify or sums is None:
        return lambda f, lo, hi: Units((), (), (), lo, hi)
    return sums.cover


def vectorized(extent: Extent) -> Extents:
    """``extent`` over arrays, one call per range: for checksums without a vectorised form
    (per-shard checksums of format versions 1 and 2: small jobs)."""

    def each(files: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = [extent(f, a, b) for f, a, b in zip(files.tolist(), lo.tolist(), hi.tolist())]
        both = np.asarray(out, dtype=np.int64).reshape(-1, 2)
        return both[:, 0], both[:, 1]

    return each
