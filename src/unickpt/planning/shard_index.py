"""Which saved shards of a tensor overlap a box: O(log N + hits) per query, not O(N).

``planning.load_plan.plan_local_load`` asks, for every target box of a loading rank, which
saved shards of its tensor overlap it. A checkpoint saved by N ranks has up to N shards per
tensor, and every loading rank plans its own load, so a scan over all shards costs each rank
O(N) per tensor it needs: the per-rank load planning then grows with the saving job's size.
:class:`ShardIndex` answers the same question (:meth:`ShardIndex.overlapping`: exactly the
shards a scan finds, in ascending index order) touching only O(log N + hits) shards for the
layouts jobs save:

* **Lexicographic bisection, no build.** ``format.build.build_metadata`` stores each tensor's
  shards sorted by their offsets. For a point inside the tensor, lexicographic order of its
  coordinates is row-major order, so the shards that overlap the box lie between the shard
  holding its first element (the last one starting at or before it) and the last one starting
  at or before its last element: two ``bisect`` calls. For a split along the first dimension
  (FSDP ``Shard(0)``) and for ZeRO / FSDP1 flat ranges (boxes contiguous in row-major order)
  that range holds exactly the overlapping shards, plus at most one; for a grid (FSDP rows x
  tensor-parallel columns) it holds the overlapping rows of the grid. A split along a later
  dimension only (column-parallel shards, with a target spanning several rows) gets no help
  from it: the range runs to the last shard, and ranges longer than ``_PYTHON_CANDIDATES`` are
  checked with numpy (Megatron saves few such shards per tensor: one per tensor-parallel rank).
* **Verified, so never wrong.** Saved shards tile their tensor (disjoint, covering, inside the
  shape: ``format.tiling``, checked at save and on decode; derived tensors of
  ``format.transforms`` are cut from disjoint row ranges). So the shards that overlap a box hold
  exactly its elements inside the shape, and a set of overlapping shards whose overlaps add up
  to that many elements is all of them. Each answer is checked that way; when the check fails
  (shards not stored in order: the index then sorts a permutation once and retries; or a layout
  the bisection misses, such as a brick wall) the query falls back to the numpy scan of all
  shards, whose table is built once per tensor and kept here.

Tensors of a regular layout (``format.layouts.SplitShards``) need none of this: the parts a box
touches follow from its rows along the split dimension (``SplitShards.overlapping``), so a rank
never materialises the shards it does not read.

A ``ShardIndex`` belongs to one ``Metadata`` object: create it, pass it to the planning calls
on that metadata (``engine.load_pipeline`` uses one for a load attempt's probes and items), and
drop it. What it caches (the sort permutation and the numpy tables of tensors that needed
them) lives in the object, never in a module global; answers depend only on the metadata.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..format.layouts import SplitShards
from ..format.records import Metadata, ShardRecord, TensorRecord

__all__ = ["ShardIndex", "INDEX_FROM", "scan_overlapping"]

Shape = tuple[int, ...]

INDEX_FROM = 16  # tensors with fewer saved shards are simply scanned
_PYTHON_CANDIDATES = 48  # larger candidate ranges of the bisection are checked with numpy


def scan_overlapping(shards: Sequence[ShardRecord], offsets: Shape, lengths: Shape) -> list[int]:
    """The reference answer: indices of the shards whose box overlaps ``(offsets, lengths)``,
    by a scan of all of them (O(N)). Used for small tensors and by the tests."""
    ends = [o + n for o, n in zip(offsets, lengths)]
    out = []
    for i, s in enumerate(shards):
        if all(max(so, to) < min(so + sn, te) for so, sn, to, te in zip(s.offsets, s.lengths, offsets, ends)):
            out.append(i)
    return out


@dataclass(frozen=True)
class _Tables:
    """Per tensor, built on the first query that needs them: shard offsets / ends as (N, ndim)
    int64 arrays in stored order, and the lexicographic order when the stored one is not it."""

    offsets: np.ndarray
    ends: np.ndarray
    order: np.ndarray | None  # None: the shards are stored sorted by offsets
    in_order: tuple[ShardRecord, ...] | None  # the shards in that order (when ``order`` is set)


@dataclass(frozen=True)
class ShardIndex:
    """Overlap queries on the shards of ``md``'s tensors (see the module docstring).

    Created by whoever plans loads on ``md`` (``plan_local_load`` makes its own when given
    none); holds lazily built per-tensor tables and is dropped with the load attempt."""

    md: Metadata
    _tables: dict[str, _Tables] = field(default_factory=dict, repr=False, compare=False)

    def overlapping(self, fqn: str, offsets: Shape, lengths: Shape) -> list[int]:
        """Indices into ``md.tensors[fqn].shards`` of the shards whose box overlaps the box
        ``(offsets, lengths)`` (non-empty intersection), ascending: what
        :func:`scan_overlapping` returns. Raises KeyError for an unknown ``fqn``."""
        rec = self.md.tensors[fqn]
        shards = rec.shards
        if isinstance(shards, SplitShards):  # a regular layout: the parts follow from the box
            return shards.overlapping(offsets, lengths)
        nd = len(rec.shape)
        if len(shards) < INDEX_FROM or nd == 0 or len(offsets) != nd or len(lengths) != nd:
            return scan_overlapping(shards, offsets, lengths)
        lo = tuple(max(o, 0) for o in offsets)
        hi = tuple(min(o + n, s) for o, n, s in zip(offsets, lengths, rec.shape))
        if any(h <= low for low, h in zip(lo, hi)):  # nothing of the box is inside the tensor
            return self._scan(fqn, rec, offsets, lengths)
        want = math.prod(h - low for low, h in zip(lo, hi))
        tables = self._tables.get(fqn)
        hits = self._bisect(fqn, rec, tables, lo, hi, want)
        if hits is None and tables is None:  # maybe stored out of order: sort once, retry
            tables = self._build(fqn, rec)
            if tables.order is not None:
                hits = self._bisect(fqn, rec, tables, lo, hi, want)
        if hits is None:
            return self._scan(fqn, rec, offsets, lengths)
        return hits

    # ------------------------------------------------------------------ internals

    def _bisect(
        self, fqn: str, rec: TensorRecord, tables: _Tables | None, lo: Shape, hi: Shape, want: int
    ) -> list[int] | None:
        """The shards overlapping the in-tensor box ``[lo, hi)`` found between the two bisection
        points of the lexicographic order, or None if their overlaps do not add up to ``want``
        elements (then some overlapping shard lies outside that range)."""
        order = None if tables is None else tables.order
        seq = rec.shards if tables is None or tables.in_order is None else tables.in_order
        first = bisect_right(seq, lo, key=_offsets) - 1
        last = tuple(h - 1 for h in hi)
        end = bisect_right(seq, last, key=_offsets)
        first = max(first, 0)
        if end - first > _PYTHON_CANDIDATES:
            found, got = self._numpy_range(fqn, rec, order, first, end, lo, hi)
        else:
            found, got = [], 0
            for i in range(first, end):
                s = seq[i]
                vol = 1
                for so, sn, a, b in zip(s.offsets, s.lengths, lo, hi):
                    n = min(so + sn, b) - max(so, a)
                    if n <= 0:
                        break
                    vol *= n
                else:
                    found.append(i)
                    got += vol
        if got != want:
            return None
        if order is None:
            return found
        return sorted(int(order[i]) for i in found)

    def _numpy_range(
        self, fqn: str, rec: TensorRecord, order: np.ndarray | None, first: int, end: int, lo: Shape, hi: Shape
    ) -> tuple[list[int], int]:
        """``_bisect``'s check of a long candidate range ``[first, end)`` with numpy: the
        positions that overlap ``[lo, hi)`` and their overlaps' total size (exact Python ints)."""
        t = self._tables.get(fqn) or self._build(fqn, rec)
        rows = np.arange(first, end) if order is None else order[first:end]
        a = np.maximum(t.offsets[rows], np.array(lo, dtype=np.int64))
        b = np.minimum(t.ends[rows], np.array(hi, dtype=np.int64))
        pos = np.flatnonzero((b > a).all(axis=1))
        spans = (b[pos] - a[pos]).tolist()
        return [first + int(p) for p in pos.tolist()], sum(math.prod(row) for row in spans)

    def _scan(self, fqn: str, rec: TensorRecord, offsets: Shape, lengths: Shape) -> list[int]:
        """All shards checked with numpy (the fallback): O(N) vectorised."""
        t = self._tables.get(fqn) or self._build(fqn, rec)
        a = np.maximum(t.offsets, np.array(offsets, dtype=np.int64))
        b = np.minimum(t.ends, np.array([o + n for o, n in zip(offsets, lengths)], dtype=np.int64))
        return np.flatnonzero((b > a).all(axis=1)).tolist()

    def _build(self, fqn: str, rec: TensorRecord) -> _Tables:
        offs = [s.offsets for s in rec.shards]
        offsets = np.array(offs, dtype=np.int64)
        ends = offsets + np.array([s.lengths for s in rec.shards], dtype=np.int64)
        ordered = all(a <= b for a, b in zip(offs, offs[1:]))
        if ordered:
            order, in_order = None, None
        else:
            perm = sorted(range(len(offs)), key=offs.__getitem__)
            order, in_order = np.array(perm, dtype=np.int64), tuple(rec.shards[i] for i in perm)
        t = self._tables[fqn] = _Tables(offsets, ends, order, in_order)
        return t


def _offsets(s: ShardRecord) -> Shape:
    return s.offsets
