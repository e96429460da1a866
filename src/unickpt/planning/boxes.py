"""N-D box geometry shared by save planning and load planning.

Save planning uses it to turn irregular shards into regular boxes: FSDP / ZeRO flatten a
parameter and give each rank a contiguous row-major range of it, which
:func:`decompose_flat_range` splits into the few boxes that tile it exactly. Load planning uses
:func:`intersect` to find which saved boxes overlap each target box, and :func:`sub_box_span`
/ :func:`sub_box_is_contiguous` to read only the needed run of a stored box. Whether boxes tile
a tensor is checked by ``format.tiling`` (one check for the metadata decoder and the planner).

Conventions: everything is counted in elements (never bytes), and every layout is row-major
(C order). A box is a pair ``(offsets, lengths)`` of equal-length tuples in global tensor
coordinates; a 0-d tensor is the box ``((), ())`` holding one element. Pure stdlib, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Shape",
    "FlatPiece",
    "numel",
    "row_major_strides",
    "chunk_bounds",
    "intersect",
    "decompose_flat_range",
    "sub_box_span",
    "sub_box_is_contiguous",
]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FlatPiece:
    """One regular box covering part of a contiguous flat (row-major) range of a tensor."""

    offsets: Shape  # box offsets in the global tensor
    lengths: Shape  # box lengths
    flat_start: int  # row-major index of the box's first element in the global tensor
    numel: int  # number of elements; the box is contiguous in row-major order


# --------------------------------------------------------------------------- validation helpers


def _check_lengths(lengths: Shape, what: str) -> Shape:
    """Return ``lengths`` as a tuple, raising ValueError for a negative entry."""
    lengths = tuple(lengths)
    if any(n < 0 for n in lengths):
        raise ValueError(f"{what} must be non-negative, got {lengths}")
    return lengths


def _check_box(offsets: Shape, lengths: Shape, what: str) -> tuple[Shape, Shape]:
    """Return a box as tuples; ValueError if its ranks differ or a length is negative."""
    offsets = tuple(offsets)
    lengths = _check_lengths(lengths, f"{what} lengths")
    if len(offsets) != len(lengths):
        raise ValueError(
            f"{what}: offsets {offsets} and lengths {lengths} have different ranks ({len(offsets)} != {len(lengths)})"
        )
    return offsets, lengths


def _same_rank(a: Shape, b: Shape, what: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"{what}: rank mismatch ({len(a)} != {len(b)}): {a} vs {b}")


# --------------------------------------------------------------------------- basics


def numel(lengths: Shape) -> int:
    """Number of elements of a box or tensor with these lengths (1 for a 0-d tensor)."""
    return math.prod(lengths)


def row_major_strides(shape: Shape) -> Shape:
    """Element strides of a contiguous row-major tensor of ``shape`` (``()`` for 0-d)."""
    strides = [1] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    return tuple(strides)


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` elements are split into ``parts``.

    Follows ``torch.chunk`` (every chunk has ``ceil(size / parts)`` elements except the last
    non-empty one) padded with empty trailing chunks so that there are always exactly ``parts``
    chunks: 5 into 4 gives lengths 2, 2, 1, 0. Used by the FSDP / DTensor adapters to work out
    which slice of a ``Shard(dim)`` placement each rank holds.
    """
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"chunk index {index} out of range for {parts} parts")
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, max(0, min(chunk, size - start))


def intersect(a_offsets: Shape, a_lengths: Shape, b_offsets: Shape, b_lengths: Shape) -> tuple[Shape, Shape] | None:
    """The overlap ``(offsets, lengths)`` of boxes a and b, or None if it is empty.

    Load planning calls this for every (target box, saved box) candidate pair. Two 0-d boxes
    ``((), ())`` intersect to ``((), ())``. Raises ValueError on rank mismatch.
    """
    if a_offsets == b_offsets and a_lengths == b_lengths and type(a_offsets) is tuple and type(a_lengths) is tuple:
        # one box twice (a target that is exactly a saved shard: the common resume)
        if len(a_offsets) == len(a_lengths) and all(n > 0 for n in a_lengths):
            return a_offsets, a_lengths
    a_offsets, a_lengths = _check_box(a_offsets, a_lengths, "box a")
    b_offsets, b_lengths = _check_box(b_offsets, b_lengths, "box b")
    _same_rank(a_offsets, b_offsets, "intersect")
    offsets: list[int] = []
    lengths: list[int] = []
    for ao, al, bo, bl in zip(a_offsets, a_lengths, b_offsets, b_lengths):
        lo = max(ao, bo)
        hi = min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)


# --------------------------------------------------------------------------- flat ranges -> boxes


def decompose_flat_range(shape: Shape, flat_start: int, count: int) -> list[FlatPiece]:
    """Split the row-major range ``[flat_start, flat_start + count)`` of a ``shape`` tensor into boxes.

    Returns the minimal ordered list of boxes, each contiguous in row-major order, that tile the
    range exactly (at most ``2 * ndim - 1`` pieces). Save planning calls this for FSDP / ZeRO
    flat shards. ``count == 0`` gives ``[]``; a 0-d tensor with ``count == 1`` gives one piece
    ``((), ())``. Costs O(ndim) per piece, independent of the number of elements.

    Algorithm (per dimension ``d`` with row size ``s = stride[d]``): peel the partial row at
    the start (recursing into dimension ``d + 1``), emit the block of whole rows in the
    middle as one box, then peel the partial row at the end (recursing again).
    """
    shape = _check_lengths(shape, "shape")
    total = numel(shape)
    if flat_start < 0 or count < 0:
        raise ValueError(f"flat range start {flat_start} and count {count} must be non-negative")
    if flat_start + count > total:
        raise ValueError(
            f"flat range [{flat_start}, {flat_start + count}) out of bounds for shape {shape} with {total} elements"
        )
    if count == 0:
        return []
    if not shape:
        return [FlatPiece((), (), 0, 1)]
    strides = row_major_strides(shape)
    pieces: list[FlatPiece] = []
    _decompose(shape, strides, 0, (), flat_start, flat_start + count, 0, pieces)
    return pieces


def _decompose(
    shape: Shape,
    strides: Shape,
    dim: int,
    prefix: Shape,
    lo: int,
    hi: int,
    base: int,
    out: list[FlatPiece],
) -> None:
    """Append the pieces of ``[lo, hi)`` (relative to ``base``) of the sub-tensor ``shape[dim:]``.

    ``prefix`` holds the fixed indices of dimensions ``< dim`` (each with length 1) and
    ``base`` the global flat index of the sub-tensor's first element. ``lo < hi``.
    """
    s = strides[dim]
    if lo % s:
        row = lo // s
        row_start = row * s
        row_hi = min(hi, row_start + s)
        _decompose(shape, strides, dim + 1, prefix + (row,), lo - row_start, row_hi - row_start, base + row_start, out)
        if row_hi == hi:
            return
        lo = row_start + s
    first_row, end_row = lo // s, hi // s
    if end_row > first_row:
        rest = len(shape) - dim - 1
        out.append(
            FlatPiece(
                offsets=prefix + (first_row,) + (0,) * rest,
                lengths=(1,) * dim + (end_row - first_row,) + shape[dim + 1 :],
                flat_start=base + lo,
                numel=(end_row - first_row) * s,
            )
        )
    if hi % s:
        row_start = end_row * s
        _decompose(shape, strides, dim + 1, prefix + (end_row,), 0, hi - row_start, base + row_start, out)


# --------------------------------------------------------------------------- sub-box reads


def sub_box_span(box_offsets: Shape, box_lengths: Shape, sub_offsets: Shape, sub_lengths: Shape) -> tuple[int, int]:
    """``(first, end)`` of the smallest contiguous run of a stored box that holds a sub-box.

    The box is stored row-major and contiguously; indices are element positions relative to
    its first element. Load planning reads just ``[first, end)`` and then views the sub-box
    inside that run with the box's row-major strides. An empty sub-box gives ``(0, 0)``.
    Raises ValueError if the sub-box is not inside the box or the ranks differ.
    """
    box_offsets, box_lengths = _check_box(box_offsets, box_lengths, "box")
    sub_offsets, sub_lengths = _check_box(sub_offsets, sub_lengths, "sub-box")
    _same_rank(box_offsets, sub_offsets, "sub_box_span")
    rel = tuple(so - bo for so, bo in zip(sub_offsets, box_offsets))
    _check_inside(box_lengths, rel, sub_lengths, box_offsets, sub_offsets)
    return _span(box_lengths, rel, sub_lengths)


def sub_box_is_contiguous(box_lengths: Shape, sub_offsets_rel: Shape, sub_lengths: Shape) -> bool:
    """True if the sub-box (offsets relative to the box) is one contiguous run of the box.

    That holds when, for some dimension k, every dimension before k has sub-length 1 and every
    dimension after k is full. Load planning uses it to read straight into the destination
    without a strided copy. Empty sub-boxes are trivially contiguous. Raises ValueError if the
    sub-box is not inside the box or the ranks differ.
    """
    if tuple(sub_lengths) == tuple(box_lengths) and len(sub_offsets_rel) == len(box_lengths):
        # the whole box (a shard read into a target of its own size: the common resume)
        if not any(sub_offsets_rel) and all(n >= 0 for n in box_lengths):
            return True
    box_lengths = _check_lengths(box_lengths, "box lengths")
    sub_offsets_rel, sub_lengths = _check_box(sub_offsets_rel, sub_lengths, "sub-box")
    _same_rank(box_lengths, sub_offsets_rel, "sub_box_is_contiguous")
    _check_inside(box_lengths, sub_offsets_rel, sub_lengths, None, None)
    first, end = _span(box_lengths, sub_offsets_rel, sub_lengths)
    return end - first == numel(sub_lengths)


def _check_inside(
    box_lengths: Shape,
    rel: Shape,
    sub_lengths: Shape,
    box_offsets: Shape | None,
    sub_offsets: Shape | None,
) -> None:
    for r, sl, bl in zip(rel, sub_lengths, box_lengths):
        if r < 0 or r + sl > bl:
            if box_offsets is None:
                raise ValueError(
                    f"sub-box (rel offsets {rel}, lengths {sub_lengths}) is not inside a box of lengths {box_lengths}"
                )
            raise ValueError(
                f"sub-box (offsets {sub_offsets}, lengths {sub_lengths}) is not inside box "
                f"(offsets {box_offsets}, lengths {box_lengths})"
            )


def _span(box_lengths: Shape, rel: Shape, sub_lengths: Shape) -> tuple[int, int]:
    if numel(sub_lengths) == 0:
        return 0, 0
    strides = row_major_strides(box_lengths)
    first = sum(r * st for r, st in zip(rel, strides))
    last = sum((r + sl - 1) * st for r, sl, st in zip(rel, sub_lengths, strides))
    return first, last + 1
