"""Where a checkpoint's saved shards lie, asked two ways (pure; both over ``format.layouts``).

* :class:`ShardIndex`, per loading rank: which saved shards of a tensor overlap a target box
  (``planning.load.overlap.plan_local_load``), O(log N + hits) per query, not O(N).
* :class:`ShardLookup`, at the coordinator: the file, byte offset, byte length and row bytes of
  the shards of many needs at once, over arrays (``planning.load._columns``, the read
  assignment over a whole job's needs).

Regular layouts (``format.layouts.SplitShards``) answer both from their arithmetic
(``SplitShards.overlapping``, ``SplitLayout.lengths`` / ``locations``), so a rank never
materialises the shards it does not read; listed shards answer from their records.

**ShardIndex.** A checkpoint saved by N ranks has up to N shards per tensor, and every loading
rank plans its own load, so a scan over all shards costs each rank O(N) per tensor it needs:
the per-rank load planning then grows with the saving job's size.
:meth:`ShardIndex.overlapping` answers with exactly the shards a scan finds, in ascending index
order, touching only O(log N + hits) shards for the layouts jobs save:

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

A ``ShardIndex`` belongs to one ``Metadata`` object: create it, pass it to the planning calls
on that metadata (``engine.load.pipeline`` uses one for a load attempt's probes and items), and
drop it. What it caches (the sort permutation and the numpy tables of tensors that needed
them) lives in the object, never in a module global; answers depend only on the metadata.

**ShardLookup.** ``ShardLookup(md, tensors)`` is prepared once for the tensors a job's needs
name (their layouts and listed shards), then asked for the byte lengths (``lengths``) or the
whole geometry (``geometry``) of any subset of needs, as often as the caller's blocks require:
``format.layouts.shard_location`` / ``shard_row_bytes`` over arrays.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...format.dtypes import itemsize
from ...format.layouts import SplitLayout, SplitShards
from ...format.records import Metadata, ShardRecord, TensorRecord

__all__ = ["ShardIndex", "INDEX_FROM", "scan_overlapping", "ShardLookup", "shard_geometry", "BLOCK"]

Shape = tuple[int, ...]

BLOCK = 1 << 20  # needs per block of a vectorised pass: its temporaries stay small and are reused
Geometry = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # files, offsets, lengths, row bytes
Tables = list[tuple[np.ndarray, np.ndarray] | None]  # per layout: SplitLayout.offset_table, or None
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


class ShardLookup:
    """Shard lookups for needs of the tensors numbered ``tensors`` (their numbers in the
    metadata's order; repeats allowed)."""

    def __init__(self, md: Metadata, tensors: np.ndarray, block: int = BLOCK) -> None:
        records = list(md.tensors.values())
        used = np.zeros(len(records) + 1, dtype=bool)
        for a in range(0, len(tensors), block):
            used[tensors[a : a + block]] = True
        grouped: dict[int, tuple[SplitLayout, list[int], list[int]]] = {}  # id -> (layout, tensors, entries)
        listed: list[int] = []
        for t in np.flatnonzero(used[:-1]).tolist():
            shards = records[t].shards
            if isinstance(shards, SplitShards):
                _, ts, es = grouped.setdefault(id(shards.layout), (shards.layout, [], []))
                ts.append(t)
                es.append(shards.entry)
            else:
                listed.append(t)
        # per layout: the entry of each of its tensors (-1 for the others)
        self._layouts: list[tuple[SplitLayout, np.ndarray]] = []
        for layout, ts, es in grouped.values():
            entry_of = np.full(len(records), -1, dtype=np.int64)
            entry_of[ts] = es
            self._layouts.append((layout, entry_of))
        # listed shards: one row each (file, offset, length, row bytes), a tensor's from first[t]
        self._first = np.zeros(len(records), dtype=np.int64)
        self._listed = np.zeros(len(records), dtype=bool)
        found: list[tuple[int, int, int, int]] = []
        for t in listed:
            rec = records[t]
            self._first[t] = len(found)
            isz = itemsize(rec.dtype)
            for s in rec.shards:
                rb = int(np.prod(s.lengths[1:], dtype=np.int64)) * isz if s.lengths else isz
                found.append((s.file_index, s.byte_offset, s.byte_length, rb))
        self._rows = np.asarray(found, dtype=np.int64).reshape(-1, 4)
        self._listed[listed] = True
        self._any_listed = bool(listed)
        self._block = block

    def lengths(self, tensor: np.ndarray, shard: np.ndarray) -> np.ndarray:
        """The byte length of each need's shard."""
        return self._each(tensor, shard, None)[0]

    def geometry(self, tensor: np.ndarray, shard: np.ndarray) -> Geometry:
        """(file index, byte offset, byte length, bytes per row of the first dimension) of each
        need's shard. Each layout's byte offsets are computed once, for the parts asked."""
        return self.located(tensor, shard, self.tables(tensor, shard))

    def tables(self, tensor: np.ndarray, shard: np.ndarray) -> Tables:
        """Each layout's byte offsets of the parts the needs ``(tensor, shard)`` ask (None for
        a layout they do not ask), for ``located`` on those needs or any part of them."""
        tables: Tables = []
        for layout, entry_of in self._layouts:
            parts = np.zeros(max(1, layout.parts), dtype=bool)
            for a in range(0, len(tensor), self._block):
                mine = entry_of[tensor[a : a + self._block]] >= 0
                parts[shard[a : a + self._block][mine]] = True
            asked = np.flatnonzero(parts)
            tables.append(layout.offset_table(asked) if len(asked) else None)  # None: no need of it here
        return tables

    def located(self, tensor: np.ndarray, shard: np.ndarray, tables: Tables) -> Geometry:
        """``geometry`` with the offset ``tables`` of needs that include these."""
        out = self._each(tensor, shard, tables)
        return out[0], out[1], out[2], out[3]

    def _each(self, tensor: np.ndarray, shard: np.ndarray, tables: Tables | None) -> list[np.ndarray]:
        """Lengths (``tables`` None) or the whole geometry, in blocks (only the answer is
        allocated whole)."""
        n = len(tensor)
        kinds = (np.int32, np.int64, np.int64, np.int64) if tables is not None else (np.int64,)  # files fit 32 bits
        out = [np.zeros(n, dtype=k) for k in kinds]
        rows = self._rows if tables is not None else self._rows[:, 2:3]
        for a in range(0, n, self._block):  # each need's values from its layout or its listed shard
            tb, sh = tensor[a : a + self._block], shard[a : a + self._block].astype(np.int64)
            for i, (layout, entry_of) in enumerate(self._layouts):
                table = tables[i] if tables is not None else None
                if tables is not None and table is None:
                    continue  # no need of this layout here
                entries = entry_of[tb]
                mine = np.flatnonzero(entries >= 0)
                if not len(mine):
                    continue
                whole = len(mine) == len(tb)  # the block's needs all of this layout: no selection
                e, p = (entries, sh) if whole else (entries[mine], sh[mine])
                got = (layout.lengths(e, p),) if table is None else layout.locations(e, p, table)
                for column, values in zip(out, got):
                    if whole:
                        column[a : a + len(tb)] = values
                    else:
                        column[a + mine] = values
            if self._any_listed:
                mine = np.flatnonzero(self._listed[tb])
                at = self._first[tb[mine]] + sh[mine]
                for column, values in zip(out, rows.T):
                    column[a + mine] = values[at]
        return out


def shard_geometry(
    md: Metadata, tensor: np.ndarray, shard: np.ndarray, block: int = BLOCK
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``ShardLookup.geometry`` of the needs ``(tensor, shard)``, computed in blocks of ``block``."""
    return ShardLookup(md, tensor, block).geometry(tensor, shard)
