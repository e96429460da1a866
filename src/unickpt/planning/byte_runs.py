"""Which bytes a rank reads (pure functions): the part of each saved shard it needs, and those
byte spans grouped into runs, each run one contiguous stretch of one file that starts and ends on
the checksum units covering it (``format.checksums``).

Called by ``engine.read`` on every rank after the read assignment: ``needed_rows`` for each
saved shard this rank reads only for itself (it needs the rows its copies touch, not the whole
shard: a resharding load to another world size reads a part of each boundary shard), then
``plan_runs`` over all spans of the rank. Two spans whose covering units overlap go into one run
(a unit is read and verified once); spans closer than ``merge_gap`` bytes too (one read instead
of many for small tensors saved next to each other).

Why rows: a saved box is stored row-major, so the rows ``[r0, r1)`` of its first dimension are
one contiguous byte range; a copy out of the box touches the rows of its own first-dimension
range. For row splits (FSDP ``Shard(0)``, TP column-parallel weights) that is exactly the bytes
needed; for column splits the rows span most of the box.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .specs import Shape

__all__ = ["Span", "Run", "needed_rows", "row_bytes", "plan_runs", "MERGE_GAP"]

MERGE_GAP = 4096  # spans whose covers are at most this far apart are read as one (alignment padding)


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
