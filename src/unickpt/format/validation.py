"""Checkpoint validation: the one home of every consistency check on metadata and on what a load
asks of it. Pure functions; each collects every problem it finds and the caller raises once.

Where each check runs:

- **Decoding** (``format.v1.read_body``, for every format version): per tensor
  :func:`tensor_problems` (size, then the bounds of every shard row: non-negative, below
  ``MAX_BYTES``, inside the shape, a known file, byte length = box size; then coverage, i.e. the
  shards tile the tensor, via ``format.tiling``), :func:`blob_problems` per blob,
  :func:`file_name_problems`, :func:`byte_range_problems` over every range of every file and
  :func:`checksum_problems` (the checksums' consistency; where the metadata records file sizes,
  format version 3, every range inside its file). The reader turns the collected sentences into
  one ``CorruptMetadataError``.
- **Save planning** (``planning.save.plan.plan_save``, the plan's self-check):
  :func:`box_coverage_problem` on the boxes the ranks will write and :func:`byte_range_problems`
  on the byte layout, so a plan that passes decodes; one ``PlanningError``.
- :func:`validate_metadata` runs the decoder's checks on a ``Metadata`` built in memory (``ops``,
  tests, writers that assemble records by hand).

What a load asks of the metadata (keys, shapes, dtypes of its targets) is checked by
``planning.load.targets``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ..errors import CorruptMetadataError
from .dtypes import itemsize
from .records import BlobRecord, Metadata, TensorRecord
from .tiling import check_box_tiling, check_tiling

__all__ = [
    "MAX_BYTES",
    "MAX_NDIM",
    "Problems",
    "corrupt",
    "shard_table",
    "tensor_problems",
    "coverage_problem",
    "box_coverage_problem",
    "blob_problems",
    "file_name_problems",
    "byte_range_problems",
    "overlap_problems",
    "OwnedRanges",
    "splits_one_dim",
    "RangeGroup",
    "extent_problems",
    "checksum_problems",
    "CRC_LIMIT",
    "validate_metadata",
]

MAX_BYTES = 1 << 56  # 64 PiB: no tensor, shard, file offset or blob is larger (absurd beyond)
MAX_NDIM = 64
CRC_LIMIT = 1 << 32  # checksums are 32-bit


class Problems:
    """Problem sentences collected by the checks: the first ``keep`` are kept, all are counted.

    ``raise_if_any(make)`` raises ``make(text)`` once, ``text`` being the one sentence or
    ``"N problems:"`` followed by the kept ones, one per line."""

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self.count = 0
        self.items: list[str] = []

    def add(self, sentence: str) -> None:
        self.count += 1
        if len(self.items) < self.keep:
            self.items.append(sentence)

    def extend(self, sentences: Iterable[str]) -> None:
        for s in sentences:
            self.add(s)

    def __bool__(self) -> bool:
        return self.count > 0

    def text(self) -> str:
        if self.count == 1:
            return self.items[0]
        more = f"\n  ... and {self.count - len(self.items)} more" if self.count > len(self.items) else ""
        return f"{self.count} problems:" + "".join(f"\n  {s}" for s in self.items) + more

    def raise_if_any(self, make: Callable[[str], Exception]) -> None:
        if self.count:
            raise make(self.text())


def corrupt(source: str, what: str) -> CorruptMetadataError:
    """The decoder's error: ``corrupt checkpoint metadata {source}: {what}``."""
    return CorruptMetadataError(f"corrupt checkpoint metadata {source}: {what}")


# --------------------------------------------------------------------------- tensors and bytes


def shard_table(rec: TensorRecord) -> np.ndarray:
    """The shards of ``rec`` as the (n, 2 * ndim + 3) int64 table the checks read: one row
    ``[*offsets, *lengths, file_index, byte_offset, byte_length]`` per shard. TypeError for a
    field that is not an int, OverflowError for one beyond int64, ValueError for a box whose rank
    is not the tensor's."""
    width = 2 * len(rec.shape) + 3
    rows = [[*s.offsets, *s.lengths, s.file_index, s.byte_offset, s.byte_length] for s in rec.shards]
    if any(type(v) is not int for row in rows for v in row):
        raise TypeError(f"tensor {rec.fqn!r}: shard fields must be ints")
    return np.array(rows, dtype=np.int64).reshape(len(rows), width)


def tensor_problems(fqn: str, shape: tuple[int, ...], dtype: str, table: np.ndarray, nfiles: int | None) -> list[str]:
    """Everything wrong with one tensor's shards (``table`` as :func:`shard_table`); ``nfiles``
    None skips the file-index check (the file list itself was unreadable). Coverage is checked
    only when every row is in bounds. Sentences start with ``tensor 'fqn':``."""
    head = f"tensor {fqn!r}:"
    try:
        isz = itemsize(dtype)
    except CorruptMetadataError:
        return [f"{head} unknown dtype {dtype!r}"]
    if len(shape) > MAX_NDIM or any(d < 0 or d > MAX_BYTES for d in shape):
        return [f"{head} shape {shape} is not a list of at most {MAX_NDIM} sizes in [0, {MAX_BYTES}]"]
    if math.prod(shape) * isz > MAX_BYTES:
        return [f"{head} shape {shape} is absurdly large"]
    nd = len(shape)
    if table.ndim != 2 or table.shape[1] != 2 * nd + 3:
        return [f"{head} shard rows do not have the {2 * nd + 3} fields of a rank-{nd} tensor"]
    out = _row_problems(head, shape, isz, table, nfiles)
    if out:
        return out
    problem = coverage_problem(shape, table[:, :nd], table[:, nd : 2 * nd])
    return [f"{head} {problem}"] if problem is not None else []


def _row_problems(head: str, shape: tuple[int, ...], isz: int, table: np.ndarray, nfiles: int | None) -> list[str]:
    """Bounds of every row; one sentence per kind of problem (its first row). Small tables that
    pass (nearly all) are accepted by a plain loop; the vectorised checks below are the
    authority for anything else and say what is wrong."""
    if table.size <= _SMALL and _rows_ok(shape, isz, table.tolist(), nfiles):
        return []
    nd = len(shape)
    offs, lens = table[:, :nd], table[:, nd : 2 * nd]
    fidx, boff, blen = (table[:, 2 * nd + i] for i in range(3))
    kinds: list[tuple[Any, Callable[[int], str]]] = [
        ((table < 0).any(axis=1), lambda i: f"negative field {int(table[i].min())}"),
        ((table > MAX_BYTES).any(axis=1), lambda i: f"absurd value {int(table[i].max())} (above {MAX_BYTES})"),
        (
            (offs + lens > np.asarray(shape, dtype=np.int64)).any(axis=1),
            lambda i: f"box {_box(offs[i], lens[i])} outside shape {shape}",
        ),
        (boff + blen > MAX_BYTES, lambda i: f"byte range [{int(boff[i])}, {int(boff[i] + blen[i])}) is absurd"),
        (
            blen != np.prod(lens, axis=1, dtype=np.int64) * isz,
            lambda i: f"byte length {int(blen[i])} != box size {math.prod(int(v) for v in lens[i]) * isz}",
        ),
    ]
    if nfiles is not None:
        kinds.insert(3, (fidx >= nfiles, lambda i: f"names file #{int(fidx[i])} of {nfiles} (file index out of range)"))
    out = []
    for mask, say in kinds:
        bad = np.flatnonzero(mask)
        if len(bad):
            more = f" (and {len(bad) - 1} more rows)" if len(bad) > 1 else ""
            out.append(f"{head} shard row {int(bad[0])}: {say(int(bad[0]))}{more}")
    return out


_SMALL = 256  # shard tables of at most this many fields are first checked with a plain loop


def _rows_ok(shape: tuple[int, ...], isz: int, rows: list[list[int]], nfiles: int | None) -> bool:
    """True iff every row passes every check of :func:`_row_problems` (property-tested to agree)."""
    nd = len(shape)
    limit = MAX_BYTES if nfiles is None else nfiles - 1
    for row in rows:
        for v in row:
            if v < 0 or v > MAX_BYTES:
                return False
        size = isz
        for d in range(nd):
            if row[d] + row[nd + d] > shape[d]:
                return False
            size *= row[nd + d]
        fidx, boff, blen = row[2 * nd :]
        if fidx > limit or boff + blen > MAX_BYTES or blen != size:
            return False
    return True


def _box(offs: np.ndarray, lens: np.ndarray) -> str:
    return f"{tuple(int(v) for v in offs)}+{tuple(int(v) for v in lens)}"


def coverage_problem(shape: Sequence[int], offsets: np.ndarray, lengths: np.ndarray) -> str | None:
    """None if the boxes tile ``shape`` exactly once, else the sentence of
    ``format.tiling.check_tiling`` (which element is covered how often, by which boxes).

    Few boxes that split the shape along at most one dimension (an unsharded tensor, a row or
    column sharding: nearly every tensor) are accepted by :func:`splits_one_dim` without the
    corner sort; anything else, and every failure, goes to ``check_tiling``."""
    if len(offsets) <= _FEW and splits_one_dim(tuple(int(s) for s in shape), offsets.tolist(), lengths.tolist()):
        return None
    problem = check_tiling(shape, offsets, lengths)
    return None if problem is None else str(problem)


_FEW = 64


def splits_one_dim(shape: tuple[int, ...], offsets: list[list[int]], lengths: list[list[int]]) -> bool:
    """True only if the boxes tile ``shape``: every box is in bounds; the non-empty ones span the
    whole shape in every dimension but one, d, and their intervals along d, sorted, follow each
    other from 0 to ``shape[d]`` without gap or overlap (then every element is covered once).
    False means "not this simple layout", not "no tiling"."""
    if len(offsets) == 1 and lengths[0] == list(shape) and not any(offsets[0]) and len(offsets[0]) == len(shape):
        return all(s > 0 for s in shape)  # one box, the whole tensor (an unsharded tensor)
    nonempty = []
    for o, n in zip(offsets, lengths):
        if len(o) != len(shape) or any(a < 0 or b < 0 or a + b > s for a, b, s in zip(o, n, shape)):
            return False
        if all(n):
            nonempty.append((o, n))
    if not nonempty or 0 in shape:
        return False
    split = {d for o, n in nonempty for d, s in enumerate(shape) if o[d] != 0 or n[d] != s}
    if not split:
        return len(nonempty) == 1
    if len(split) > 1:
        return False
    d = split.pop()
    end = 0
    for start, length in sorted((o[d], n[d]) for o, n in nonempty):
        if start != end:
            return False
        end = start + length
    return end == shape[d]


def box_coverage_problem(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """:func:`coverage_problem` for ``(offsets, lengths)`` pairs of Python ints (the planner's
    boxes; out-of-bounds boxes are reported too). ValueError if a box's rank differs."""
    shape = tuple(shape)
    if len(boxes) <= _FEW and splits_one_dim(shape, [list(o) for o, _ in boxes], [list(n) for _, n in boxes]):
        return None
    problem = check_box_tiling(shape, boxes)
    return None if problem is None else str(problem)


def blob_problems(blob: BlobRecord, nfiles: int | None) -> list[str]:
    """Bounds of one blob's byte range (``blob 'key': ...``)."""
    head = f"blob {blob.key!r}"
    vals = (blob.file_index, blob.byte_offset, blob.byte_length)
    if any(type(v) is not int or not 0 <= v <= MAX_BYTES for v in vals):
        return [f"{head}: fields must be integers in [0, {MAX_BYTES}], got {list(vals)}"]
    out = []
    if nfiles is not None and blob.file_index >= nfiles:
        out.append(f"{head} names file #{blob.file_index} of {nfiles}")
    if blob.byte_offset + blob.byte_length > MAX_BYTES:
        end = blob.byte_offset + blob.byte_length
        out.append(f"{head}: byte range [{blob.byte_offset}, {end}) is absurd")
    return out


def file_name_problems(files: Sequence[str]) -> list[str]:
    """Data file names stay inside the checkpoint folder (relative, no ``..``, no backslash, not
    empty) and are listed once (two indices naming one file would hide overlapping ranges)."""
    out = []
    seen: set[str] = set()
    for f in files:
        if f.startswith("/") or ".." in f.split("/") or "\\" in f or not f:
            out.append(f"file name {f!r} escapes the checkpoint folder")
        elif f in seen:
            out.append(f"file name {f!r} is listed twice")
        seen.add(f)
    return out


@dataclass(frozen=True)
class OwnedRanges:
    """Byte ranges of many owners at once (``byte_range_problems``' ranges, built without an array
    per owner): row i is ``[byte_offset[i], + byte_length[i])`` of file ``file_index[i]``, owned
    by ``owners[who[i]]``."""

    owners: list[str]
    who: np.ndarray
    file_index: np.ndarray
    byte_offset: np.ndarray
    byte_length: np.ndarray


RangeGroup = Union[tuple[str, np.ndarray, np.ndarray, np.ndarray], OwnedRanges]  # noqa: UP007 - a runtime alias


def _flat_ranges(ranges: Iterable[RangeGroup]) -> tuple[list[str], list[tuple[np.ndarray, ...]]]:
    owners: list[str] = []
    parts: list[tuple[np.ndarray, ...]] = []
    for group in ranges:
        if isinstance(group, OwnedRanges):
            if len(group.who):
                parts.append((group.who + len(owners), group.file_index, group.byte_offset, group.byte_length))
            owners.extend(group.owners)
            continue
        owner, fidx, boff, blen = group
        if len(fidx):
            parts.append((np.full(len(fidx), len(owners), dtype=np.int64), fidx, boff, blen))
            owners.append(owner)
    return owners, parts


def byte_range_problems(files: Sequence[str], ranges: Iterable[RangeGroup]) -> list[str]:
    """No two byte ranges of one file overlap. ``ranges``: per owner (a tensor fqn or blob key),
    its ``(owner, file_index, byte_offset, byte_length)`` arrays, or many owners' rows at once
    (``OwnedRanges``), in bounds (file indices below ``len(files)``). See :func:`overlap_problems`."""
    owners, parts = _flat_ranges(ranges)
    if not parts:
        return []
    who, fidx, boff, blen = (np.concatenate([p[k] for p in parts]) for k in range(4))
    return overlap_problems(files, owners, who, fidx, boff, blen)


def overlap_problems(
    files: Sequence[str],
    owners: Sequence[str],
    who: np.ndarray,
    file_index: np.ndarray,
    byte_offset: np.ndarray,
    byte_length: np.ndarray,
) -> list[str]:
    """No two byte ranges of one file overlap; range i is ``[byte_offset[i], + byte_length[i])``
    of ``files[file_index[i]]``, owned by ``owners[who[i]]`` (all in bounds). Sorted by (file,
    offset, length), some pair of ranges overlaps iff some adjacent pair does (the later one
    starts before the earlier one ends), so one sort finds them: O(n log n), vectorised. One
    sentence per overlapping adjacent pair."""
    if not len(who):
        return []
    arrays = (np.asarray(a, dtype=np.int64) for a in (who, file_index, byte_offset, byte_length))
    who, fidx, boff, blen = arrays
    order = np.lexsort((who, blen, boff, fidx))
    who, fidx, boff, blen = who[order], fidx[order], boff[order], blen[order]
    bad = np.flatnonzero((fidx[1:] == fidx[:-1]) & (boff[:-1] + blen[:-1] > boff[1:]))
    return [
        f"byte ranges of {owners[who[i]]!r} and {owners[who[i + 1]]!r} overlap in {files[int(fidx[i])]}"
        for i in bad.tolist()
    ]


def extent_problems(files: Sequence[str], sizes: Sequence[int], ranges: Iterable[RangeGroup]) -> list[str]:
    """Every byte range lies inside its file (``sizes``: each file's recorded size; ranges as
    :func:`byte_range_problems`, in bounds). One sentence per owner with a range past its file's end."""
    limit = np.asarray(sizes, dtype=np.int64)
    owners, parts = _flat_ranges(ranges)
    out = []
    for who, fidx, boff, blen in parts:
        bad = np.flatnonzero((blen > 0) & (boff + blen > limit[fidx]))  # an empty range holds no byte
        seen = set()
        for i in bad.tolist():
            w = int(who[i])
            if w in seen:
                continue
            seen.add(w)
            f = int(fidx[i])
            out.append(
                f"{owners[w]!r}: byte range [{int(boff[i])}, {int(boff[i] + blen[i])}) ends past the "
                f"{int(limit[f])} bytes recorded for {files[f]}"
            )
    return out


def checksum_problems(md: Metadata, ranges: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]) -> list[str]:
    """The checksums' own consistency and, where they record file sizes, every range inside its
    file (``ranges`` as :func:`byte_range_problems`, in bounds)."""
    sums = md.checksums
    if sums is None:
        return []
    own = getattr(sums, "problems", None)
    found = list(own()) if own is not None else []
    sizes = getattr(sums, "file_sizes", None)
    if found or sizes is None:
        return found
    if len(sizes) != len(md.files):
        return [f"checksums record {len(sizes)} file sizes for {len(md.files)} files"]
    return extent_problems(md.files, sizes, ranges)


def validate_metadata(md: Metadata, source: str = "<metadata>") -> None:
    """The decoder's checks of files, tensors, blobs, byte ranges and checksums, on records built
    in memory (field types and sections are the codec's business); one ``CorruptMetadataError``
    (``corrupt checkpoint metadata {source}: ...``) listing every problem."""
    problems = Problems()
    problems.extend(file_name_problems(md.files))
    nfiles = len(md.files)
    ranges = []
    for fqn, rec in md.tensors.items():
        try:
            table = shard_table(rec)
        except (OverflowError, ValueError, TypeError):
            problems.add(f"tensor {fqn!r}: a shard field is not a 64-bit integer or a box has the wrong rank")
            continue
        found = tensor_problems(fqn, tuple(rec.shape), rec.dtype, table, nfiles)
        problems.extend(found)
        if not found:
            nd = len(rec.shape)
            ranges.append((fqn, table[:, 2 * nd], table[:, 2 * nd + 1], table[:, 2 * nd + 2]))
    for key, blob in md.blobs.items():
        found = blob_problems(blob, nfiles)
        problems.extend(found)
        if not found:
            one = np.array([blob.file_index, blob.byte_offset, blob.byte_length], dtype=np.int64)
            ranges.append((key, one[0:1], one[1:2], one[2:3]))
    problems.extend(byte_range_problems(md.files, ranges))
    if not problems:
        problems.extend(checksum_problems(md, ranges))
    problems.raise_if_any(lambda text: corrupt(source, text))
