"""Regular layouts: tensors split the same way over many files, described once (format version 3).

A job whose ranks each hold the same slice of every tensor (FSDP's ``Shard(0)`` over all ranks,
ZeRO-3: rank p holds chunk p of each tensor) writes files that all look alike: file p holds
chunk p of tensor 1, then chunk p of tensor 2, ... each at the next 64-byte boundary. A
:class:`SplitLayout` says exactly that (the files, one per part, and the tensors in byte order
with the dimension they are split along), so the metadata grows with the tensors, not with
tensors x ranks: a tensor of such a layout has no shard rows, and its shards
(:class:`SplitShards`) are computed when read, each byte offset from the sizes of the chunks
before it in its file. Chunks follow ``torch.chunk``: ``c = ceil(n / parts)`` rows each, the last
ones shorter or empty.

Order of use: the coordinator's commit (``format.build``) builds layouts for the groups the
save plan found regular; ``format.v3`` writes and reads them (``layout_problems`` checks one:
files, dimensions, every chunk inside its file); loads ask a tensor's shards like any other
(``TensorRecord.shards``: a sequence), and ``planning.load.shards`` asks
``SplitShards.overlapping`` for the parts a box touches in O(parts touched).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from .records import ShardRecord

__all__ = ["SplitLayout", "SplitShards", "chunk_rows", "ALIGN"]

ALIGN = 64  # entries start at multiples of this (planning.save.model.ENTRY_ALIGN)
_CACHED = 1024  # parts whose byte offsets a layout keeps (8 bytes per entry each)
_KEPT = 16  # SplitShards of at most this many parts keep their records once computed
Shape = tuple[int, ...]


def chunk_rows(n: int, parts: int, p: int) -> tuple[int, int]:
    """``torch.chunk``'s part ``p`` of ``n`` rows in ``parts`` (padded to ``parts`` with empty
    ones): (first row, rows)."""
    c = -(-n // parts) if parts else 0
    lo = min(n, p * c)
    return lo, min(n, lo + c) - lo


@dataclass(frozen=True, eq=False)
class SplitLayout:
    """Part ``p`` of every entry lives in file ``files[p]``; in each file the entries follow each
    other in ``entries`` order, each at the next ``ALIGN`` boundary from offset 0. An entry is
    ``(fqn, itemsize, shape, dim)``: the tensor, its element size, its shape, the dimension its
    chunks split."""

    files: tuple[int, ...]
    entries: tuple[tuple[str, int, Shape, int], ...]
    # per entry, as arrays: rows along the split dimension, rows per chunk, bytes per row
    _n: np.ndarray = field(init=False, repr=False)
    _c: np.ndarray = field(init=False, repr=False)
    _row: np.ndarray = field(init=False, repr=False)
    _offsets: dict[int, np.ndarray] = field(init=False, repr=False)
    _files: np.ndarray = field(init=False, repr=False)
    # per entry, for ``locations``: bytes of one index of dimension 0 when split along it; per
    # row of the split dimension otherwise; the split dimension
    _dim0: tuple[np.ndarray, np.ndarray, np.ndarray] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parts = max(1, len(self.files))
        n = [shape[d] for _, _, shape, d in self.entries]
        row = [(math.prod(shape) // shape[d] if shape[d] else 0) * isz for _, isz, shape, d in self.entries]
        object.__setattr__(self, "_n", np.array(n, dtype=np.int64))
        object.__setattr__(self, "_c", -(-np.array(n, dtype=np.int64) // parts))
        object.__setattr__(self, "_row", np.array(row, dtype=np.int64))
        object.__setattr__(self, "_offsets", {})
        object.__setattr__(self, "_files", np.asarray(self.files, dtype=np.int64))
        first = [math.prod(shape[1:]) * isz for _, isz, shape, _ in self.entries]
        other = [(math.prod(shape[1:]) // shape[d] if d and shape[d] else 0) * isz for _, isz, shape, d in self.entries]
        dims = [d for *_, d in self.entries]
        object.__setattr__(self, "_dim0", tuple(np.array(x, dtype=np.int64) for x in (first, other, dims)))

    @property
    def parts(self) -> int:
        return len(self.files)

    def box(self, e: int, p: int) -> tuple[Shape, Shape]:
        _, _, shape, d = self.entries[e]
        lo, n = chunk_rows(shape[d], self.parts, p)
        offs, lens = [0] * len(shape), list(shape)
        offs[d], lens[d] = lo, n
        return tuple(offs), tuple(lens)

    def _sizes(self, p: int) -> np.ndarray:
        """Byte length of part ``p`` of every entry (vectorised over the entries)."""
        return np.clip(self._n - p * self._c, 0, self._c) * self._row

    def offsets(self, p: int) -> np.ndarray:
        """Byte offset of part ``p`` of every entry in file ``files[p]`` (cached per part: a
        load touches a few parts; the cache holds at most ``_CACHED`` of them)."""
        found = self._offsets.get(p)
        if found is None:
            aligned = -(-self._sizes(p) // ALIGN) * ALIGN
            found = np.cumsum(aligned) - aligned
            if len(self._offsets) >= _CACHED:
                self._offsets.pop(next(iter(self._offsets)))
            self._offsets[p] = found
        return found

    def ends(self) -> np.ndarray:
        """Where the layout's bytes end in each file: the end of its last non-empty chunk there
        (all parts at once, vectorised per entry). What the metadata's file sizes and any other
        byte range of those files are checked against."""
        if self.parts <= len(self.entries):  # few parts (a small job): a pass over the entries per part
            end = np.zeros(self.parts, dtype=np.int64)
            for p in range(self.parts):
                sizes = self._sizes(p)
                filled = np.flatnonzero(sizes)
                if len(filled):
                    last = int(filled[-1])
                    end[p] = int(self.offsets(p)[last]) + int(sizes[last])
            return end
        parts = np.arange(self.parts, dtype=np.int64)
        pos = np.zeros(self.parts, dtype=np.int64)
        end = np.zeros(self.parts, dtype=np.int64)
        for n, c, row in zip(self._n.tolist(), self._c.tolist(), self._row.tolist()):
            size = np.clip(n - parts * c, 0, c) * row
            end = np.where(size > 0, pos + size, end)
            pos += -(-size // ALIGN) * ALIGN
        return end

    def location(self, e: int, p: int) -> tuple[int, int, int]:
        """(file index, byte offset, byte length) of part ``p`` of entry ``e``: ``shard``'s
        location without its box (what a read assignment over many shards looks up)."""
        n, c = int(self._n[e]), int(self._c[e])
        rows = min(max(n - p * c, 0), c)
        return self.files[p], int(self.offsets(p)[e]), rows * int(self._row[e])

    def offset_table(self, parts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte offsets of every entry in each part of ``parts`` (part numbers, repeats
        allowed), computed once for ``locations``: (the offsets, one row per part present; each
        part's row number)."""
        present = np.zeros(max(1, self.parts), dtype=bool)
        present[parts] = True
        rows = np.flatnonzero(present)
        out = np.empty((len(rows), len(self.entries)), dtype=np.int64)
        step = max(1, (1 << 20) // max(1, len(self.entries)))  # parts per block: temporaries stay small
        for a in range(0, len(rows), step):
            p = rows[a : a + step, None]
            aligned = -(-(np.clip(self._n[None, :] - p * self._c[None, :], 0, self._c[None, :]) * self._row) // ALIGN)
            aligned *= ALIGN
            np.cumsum(aligned, axis=1, out=out[a : a + step])
            out[a : a + step] -= aligned
        return out, np.cumsum(present) - 1

    def locations(
        self, e: np.ndarray, p: np.ndarray, table: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``location`` of many chunks at once (entries ``e``, parts ``p``, arrays of equal
        length) and each chunk's bytes per row of its first dimension (``SplitShards.row_bytes``):
        (file indices, byte offsets, byte lengths, row bytes). ``table``: ``offset_table`` of
        parts that include ``p`` (a caller asking in blocks computes it once)."""
        offsets_of, row_of = table if table is not None else self.offset_table(p)
        rows = self._rows(e, p)
        offsets = offsets_of.ravel()[row_of[p] * len(self.entries) + e]
        first, other, dims = self._dim0
        row_bytes = np.where(dims[e] == 0, first[e], other[e] * rows)
        return self._files[p], offsets, rows * self._row[e], row_bytes

    def lengths(self, e: np.ndarray, p: np.ndarray) -> np.ndarray:
        """The byte length of many chunks at once (``locations``' third column, alone)."""
        return self._rows(e, p) * self._row[e]

    def _rows(self, e: np.ndarray, p: np.ndarray) -> np.ndarray:
        """Rows along the split dimension of part ``p`` of entry ``e`` (``torch.chunk``'s)."""
        c = self._c[e]
        return np.clip(self._n[e] - p * c, 0, c)

    def shard(self, e: int, p: int) -> ShardRecord:
        offs, lens = self.box(e, p)
        _, isz, _, _ = self.entries[e]
        return ShardRecord(offs, lens, self.files[p], int(self.offsets(p)[e]), math.prod(lens) * isz)

    def same_as(self, other: SplitLayout) -> bool:
        return self.files == other.files and self.entries == other.entries


class SplitShards(Sequence[ShardRecord]):
    """The shards of entry ``e`` of a ``SplitLayout``, part by part (part ``i`` is shard ``i``,
    empty parts included), computed when asked; with few parts (at most ``_KEPT``: a small job,
    where every tensor's shards are asked several times by one load) computed once and kept."""

    __slots__ = ("_kept", "entry", "layout")

    def __init__(self, layout: SplitLayout, entry: int) -> None:
        self.layout, self.entry = layout, entry
        self._kept: tuple[ShardRecord, ...] | None = None

    def _all(self) -> tuple[ShardRecord, ...] | None:
        if self._kept is None and self.layout.parts <= _KEPT:
            self._kept = tuple(self.layout.shard(self.entry, k) for k in range(self.layout.parts))
        return self._kept

    def __len__(self) -> int:
        return self.layout.parts

    @overload
    def __getitem__(self, i: int) -> ShardRecord: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ShardRecord]: ...

    def __getitem__(self, i: int | slice) -> Any:
        kept = self._all()
        if kept is not None:
            return kept[i]
        if isinstance(i, slice):
            return tuple(self.layout.shard(self.entry, k) for k in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.layout.shard(self.entry, i)

    def __iter__(self) -> Iterator[ShardRecord]:
        kept = self._all()
        if kept is not None:
            return iter(kept)
        return (self.layout.shard(self.entry, k) for k in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SplitShards):
            return self.entry == other.entry and self.layout.same_as(other.layout)
        if isinstance(other, Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.layout.files, self.layout.entries[self.entry], self.entry))

    def __repr__(self) -> str:
        fqn, _, shape, d = self.layout.entries[self.entry]
        return f"SplitShards({fqn!r}, shape={shape}, dim={d}, parts={len(self)})"

    @property
    def dim(self) -> int:
        return self.layout.entries[self.entry][3]

    def location(self, i: int) -> tuple[int, int, int]:
        """(file index, byte offset, byte length) of shard ``i`` (``SplitLayout.location``)."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.layout.location(self.entry, i)

    def row_bytes(self, i: int) -> int:
        """Bytes of one row (one index of the first dimension) of shard ``i``'s box, as
        ``planning.load.runs.row_bytes`` of its lengths, without building its record."""
        _, isz, shape, d = self.layout.entries[self.entry]
        if d == 0:
            return math.prod(shape[1:]) * isz
        lengths = list(shape[1:])
        lengths[d - 1] = chunk_rows(shape[d], self.layout.parts, i)[1]
        return math.prod(lengths) * isz

    def exact_part(self, offsets: Shape, lengths: Shape) -> tuple[int, ShardRecord] | None:
        """The part whose box is exactly ``(offsets, lengths)`` (non-empty: a target laid out as
        the saving job's) and its record (what ``self[p]`` is), or None when no part's box is
        (``overlapping`` then says which parts it touches). O(1): the part follows from the
        offset along the split dimension; no other part's record is built."""
        lay = self.layout
        _, isz, shape, d = lay.entries[self.entry]
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            return None
        o, n = offsets[d], shape[d]
        c = -(-n // lay.parts)
        if c == 0 or o < 0 or o % c or o // c >= lay.parts or lengths[d] != min(n, o + c) - o:
            return None
        # every other dimension whole, and the box not empty
        if lengths[:d] != shape[:d] or lengths[d + 1 :] != shape[d + 1 :] or any(offsets[:d]) or any(offsets[d + 1 :]):
            return None
        if 0 in lengths:
            return None
        p = o // c
        nbytes = math.prod(lengths) * isz
        return p, ShardRecord(tuple(offsets), tuple(lengths), lay.files[p], int(lay.offsets(p)[self.entry]), nbytes)

    def overlapping(self, offsets: Shape, lengths: Shape) -> list[int]:
        """The parts whose box overlaps ``(offsets, lengths)``: those whose rows along the split
        dimension meet the box's (every other dimension is whole), in O(parts touched)."""
        _, _, shape, d = self.layout.entries[self.entry]
        for o, n, s in zip(offsets, lengths, shape):
            if n <= 0 or o + n <= 0 or o >= s:
                return []
        lo, hi = max(offsets[d], 0), min(offsets[d] + lengths[d], shape[d])
        c = -(-shape[d] // self.layout.parts)
        if c == 0 or hi <= lo:
            return []
        return list(range(lo // c, min(self.layout.parts, -(-hi // c))))


def shard_location(shards: Sequence[ShardRecord], i: int) -> tuple[int, int, int]:
    """(file index, byte offset, byte length) of a tensor's shard ``i``, without building its
    record when ``shards`` is a regular layout's (read assignments look up many shards)."""
    if isinstance(shards, SplitShards):
        return shards.location(i)
    s = shards[i]
    return s.file_index, s.byte_offset, s.byte_length


def shard_row_bytes(shards: Sequence[ShardRecord], i: int, itemsize: int) -> int:
    """Bytes of one row (one index of the first dimension) of a tensor's shard ``i``, as
    ``planning.load.runs.row_bytes`` of its lengths, without building a layout's record."""
    if isinstance(shards, SplitShards):
        return shards.row_bytes(i)
    lengths = shards[i].lengths
    return math.prod(lengths[1:]) * itemsize if lengths else itemsize
