"""Do n boxes tile an N-D tensor exactly once? One check for the metadata decoder and the planner.

Both go through ``format.validation`` (``coverage_problem``, ``box_coverage_problem``): the
decoder on the shards of every decoded tensor (a problem becomes a ``CorruptMetadataError``), the
save planner on the boxes the ranks will write (a ``PlanningError``). Both get a
:class:`TilingProblem` (or None) naming one element whose coverage is wrong, the boxes covering
it, and the run of such elements along one dimension.

**Criterion.** Let f(x) be the number of boxes holding the lattice point x and s(x) the indicator
of the whole shape. The boxes tile the shape iff f = s. Let Δ = Π_d (1 - T_d), with T_d f(x) =
f(x - e_d), the mixed finite difference. For a box [o, o + n) (n >= 0), Δ of its indicator is
Σ_{corners c} (-1)^{u(c)} δ_c over its 2^ndim corners c_d ∈ {o_d, o_d + n_d}, u(c) being the
number of "upper" coordinates o_d + n_d (a product of 1-D identities Δ_d 1_[a, b) = δ_a - δ_b;
an empty box's corners cancel in pairs). Δ is injective on finitely supported integer functions:
if Δg = 0 with g finitely supported, then g(x) = Σ_{y <= x} Δg(y) = 0 (the inverse of each
1 - T_d is the prefix sum along d). So f = s iff Δf = Δs, i.e. iff the signed corner sums of
all boxes equal those of the shape: every corner other than the shape's own cancels to zero.

**Where.** Let r = Δf - Δs and c the lexicographically smallest point with r(c) != 0. Every
y <= c (componentwise), y != c, is lexicographically smaller, so r(y) = 0 and
f(c) - s(c) = Σ_{y <= c} r(y) = r(c) != 0: the element c is covered 1 + r(c) times instead of
once. It lies inside the shape, since boxes are checked to be in bounds first and f = s = 0
outside. One O(n) scan then names the boxes covering c and the run of equally covered elements
from c along the last split dimension (no pairwise comparison, no enumeration of elements).

**Cost.** Dimensions in which every box spans the whole extent are dropped (they do not change
coverage); with k split dimensions the check sorts (n + 1) * 2^k corner keys: O(n 2^k log n),
2 * (n + 1) keys for a row sharding, 4 * (n + 1) for a 2-D grid or any staircase. When
(n + 1) * 2^k * k exceeds ``CORNER_CELLS`` (only for layouts split along many dimensions at
once) the corners are not listed; instead the identity Σ_boxes Π_d (w_d(o_d) - w_d(o_d + n_d)) =
Π_d (w_d(0) - w_d(S_d)) (Δf = Δs evaluated against a random product weight, i.e. the corner
polynomial at a random point) is tested modulo the prime 2^31 - 1 with fresh random weights,
``_ROUNDS`` times: O(k n log n). A tiling always passes; a non-tiling passes with probability
at most (k / (2^31 - 1))^3 (Schwartz-Zippel: the corner polynomial is non-zero, of degree k, and
its integer coefficients are smaller than the prime), and is then reported without a location.
So no input, however crafted, costs more than O(ndim * n log n) plus a bounded corner sort.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["TilingProblem", "check_tiling", "check_box_tiling", "CORNER_CELLS"]

Shape = tuple[int, ...]
Boxes = Sequence[tuple[Sequence[int], Sequence[int]]]

CORNER_CELLS = 1 << 23  # most corner coordinates listed by the exact check (64 MiB of int64)
_PRIME = (1 << 31) - 1  # products of two residues fit in int64
_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class TilingProblem:
    """Why boxes do not tile a shape. ``str()`` is a sentence for an error message.

    ``kind``: "outside" (a box with a negative length or outside the shape: ``boxes`` holds its
    index), "gap" / "overlap" (``element`` is covered ``count`` times; ``boxes`` holds up to two
    boxes covering it; ``run`` = (dim, start, end): the elements from ``element`` along ``dim``
    up to ``end`` are covered as often), or "mismatch" (found by the randomised check for
    layouts split along many dimensions: no location).
    """

    kind: str
    message: str
    element: Shape | None = None
    count: int = 0
    boxes: tuple[int, ...] = ()
    run: tuple[int, int, int] | None = None

    def __str__(self) -> str:
        return self.message


def check_box_tiling(shape: Sequence[int], boxes: Boxes) -> TilingProblem | None:
    """:func:`check_tiling` for ``(offsets, lengths)`` pairs of Python ints (the planner's boxes).

    Raises ValueError if a box's rank differs from the shape's."""
    shape = tuple(shape)
    nd = len(shape)
    for i, (offs, lens) in enumerate(boxes):
        if len(offs) != nd or len(lens) != nd:
            raise ValueError(f"box {i} ({tuple(offs)}+{tuple(lens)}) does not have the rank {nd} of shape {shape}")
    try:
        offsets = np.array([list(o) for o, _ in boxes], dtype=np.int64).reshape(len(boxes), nd)
        lengths = np.array([list(n) for _, n in boxes], dtype=np.int64).reshape(len(boxes), nd)
    except OverflowError:
        return TilingProblem("outside", f"a box coordinate does not fit in 64 bits (shape {shape})")
    return check_tiling(shape, offsets, lengths)


def check_tiling(shape: Sequence[int], offsets: np.ndarray, lengths: np.ndarray) -> TilingProblem | None:
    """None if the boxes ``[offsets[i], offsets[i] + lengths[i])`` cover ``shape`` exactly once.

    ``offsets`` and ``lengths`` are int64 arrays of shape (n, len(shape)); ``shape`` holds
    non-negative ints below 2^62. Empty boxes (a zero length) are allowed anywhere inside the
    shape and cover nothing; a 0-d shape is tiled by exactly one (0-d) box. The first problem is
    returned: a box with a negative length or outside the shape, else the lexicographically
    first element covered other than once (see the module docstring for the proof)."""
    shape = tuple(int(s) for s in shape)
    nd = len(shape)
    if offsets.ndim != 2 or offsets.shape[1] != nd or lengths.shape != offsets.shape:
        raise ValueError(f"boxes of shape {offsets.shape} / {lengths.shape} do not fit a tensor of rank {nd}")
    offsets, lengths = offsets.astype(np.int64, copy=False), lengths.astype(np.int64, copy=False)
    dims = np.asarray(shape, dtype=np.int64)
    # o >= 0, n >= 0 and o <= S - n (no overflow for any int64 input)
    bad = np.flatnonzero((offsets < 0).any(1) | (lengths < 0).any(1) | (offsets > dims - lengths).any(1))
    if len(bad):
        i = int(bad[0])
        box = _box_text(offsets, lengths, i)
        what = "has a negative length" if (lengths[i] < 0).any() else f"lies outside the shape {shape}"
        return TilingProblem("outside", f"shard {box} {what}", boxes=(i,))
    if math.prod(shape) == 0:
        return None  # every in-bounds box of an empty tensor is empty
    keep = np.flatnonzero((lengths > 0).all(1))  # empty boxes contribute nothing
    lo, n = offsets[keep], lengths[keep]
    # dimensions in which some box does not span the whole extent: the only ones that matter
    split = [d for d in range(nd) if ((lo[:, d] != 0) | (n[:, d] != shape[d])).any()]
    lo, hi, ext = lo[:, split], lo[:, split] + n[:, split], dims[split]
    k, m = len(split), len(keep)
    if (m + 1) << k > CORNER_CELLS // max(k, 1):
        return _fingerprint(shape, offsets, lengths, keep, lo, hi, ext)
    corner = _first_bad_corner(lo, hi, ext)
    if corner is None:
        return None
    return _locate(shape, offsets, lengths, keep, split, lo, hi, ext, corner)


def _first_bad_corner(lo: np.ndarray, hi: np.ndarray, ext: np.ndarray) -> np.ndarray | None:
    """The lexicographically smallest point where the boxes' signed corner sum differs from the
    shape's, or None if they agree everywhere (the boxes tile)."""
    m, k = lo.shape
    # per split dimension: the rank of every coordinate among the distinct ones (0 and S included)
    uniq, ranks = [], []
    for j in range(k):
        values, inverse = np.unique(np.concatenate([lo[:, j], hi[:, j], [0, ext[j]]]), return_inverse=True)
        uniq.append(values)
        ranks.append(inverse)
    # the shape is box m with sign -1; corner pattern p takes the upper end in dimension j if bit j
    patterns = np.arange(1 << k, dtype=np.int64)[:, None]
    cols = []
    for j in range(k):
        low = np.concatenate([ranks[j][:m], ranks[j][2 * m : 2 * m + 1]])
        high = np.concatenate([ranks[j][m : 2 * m], ranks[j][2 * m + 1 :]])
        cols.append(np.where((patterns >> j) & 1, high[None, :], low[None, :]).ravel())
    parity = np.zeros(1 << k, dtype=np.int64)
    for j in range(k):
        parity ^= (patterns[:, 0] >> j) & 1
    box_sign = np.ones(m + 1, dtype=np.int64)
    box_sign[m] = -1
    signs = ((1 - 2 * parity)[:, None] * box_sign[None, :]).ravel()
    if not k:
        return None if signs.sum() == 0 else np.zeros(0, dtype=np.int64)
    radix = [1] * k
    for j in range(k - 2, -1, -1):
        radix[j] = radix[j + 1] * len(uniq[j + 1])
    if radix[0] * len(uniq[0]) < 1 << 62:  # one int64 key per corner, dimension 0 most significant
        key = cols[0] * radix[0]
        for j in range(1, k):
            key += cols[j] * radix[j]
        order = np.argsort(key)
    else:
        order = np.lexsort(cols[::-1])
    sorted_cols = [c[order] for c in cols]
    new = np.zeros(len(order), dtype=bool)
    new[0] = True
    for c in sorted_cols:
        new[1:] |= c[1:] != c[:-1]
    starts = np.flatnonzero(new)
    sums = np.add.reduceat(signs[order], starts)
    wrong = np.flatnonzero(sums)
    if not len(wrong):
        return None
    first = starts[wrong[0]]
    return np.array([uniq[j][sorted_cols[j][first]] for j in range(k)], dtype=np.int64)


def _locate(
    shape: Shape,
    offsets: np.ndarray,
    lengths: np.ndarray,
    keep: np.ndarray,
    split: list[int],
    lo: np.ndarray,
    hi: np.ndarray,
    ext: np.ndarray,
    c: np.ndarray,
) -> TilingProblem:
    """Describe the element ``c`` (split coordinates) that is covered other than once: O(n)."""
    covering = np.flatnonzero(((lo <= c) & (c < hi)).all(1))
    count = len(covering)
    element = [0] * len(shape)
    for j, d in enumerate(split):
        element[d] = int(c[j])
    where = tuple(element)
    names = tuple(int(keep[i]) for i in covering[:2])
    if not split:  # every box is the whole tensor (or the tensor is 0-d)
        run = None
        span, are, tail = ("every element", "is", "") if shape else ("the element", "is", "")
    else:
        j, d = len(split) - 1, split[-1]
        same_line = ((lo[:, :j] <= c[:j]) & (c[:j] < hi[:, :j])).all(1)
        events = np.concatenate([lo[same_line, j], hi[same_line, j], ext[j : j + 1]])
        end = int(events[events > c[j]].min())
        run = (d, int(c[j]), end)
        span, are, tail = f"elements [{run[1]}, {run[2]}) of dimension {d}", "are", f" (from element {where})"
    if count == 0:
        msg = f"the shards do not cover the shape {shape}: {span} {are} not saved{tail}"
        return TilingProblem("gap", msg, where, 0, (), run)
    if count == 1:  # impossible by the proof in the module docstring; say so rather than guess
        return TilingProblem("mismatch", f"the shards do not tile the shape {shape} (near element {where})")
    times = "twice" if count == 2 else f"{count} times"
    a, b = (_box_text(offsets, lengths, i) for i in names)
    msg = f"shards {a} and {b} overlap: {span} {are} saved {times}{tail}"
    return TilingProblem("overlap", msg, where, count, names, run)


def _fingerprint(
    shape: Shape,
    offsets: np.ndarray,
    lengths: np.ndarray,
    keep: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    ext: np.ndarray,
) -> TilingProblem | None:
    """Randomised check for layouts split along many dimensions (module docstring): O(k n log n)."""
    m, k = lo.shape
    if m >= _PRIME - 1:  # corner sums could wrap modulo the prime: refuse rather than guess
        return TilingProblem("mismatch", f"{m} boxes split along {k} dimensions are too many to check")
    rng = np.random.default_rng()
    for _ in range(_ROUNDS):
        box_terms = np.ones(m, dtype=np.int64)
        shape_term = 1
        for j in range(k):
            values, inverse = np.unique(np.concatenate([lo[:, j], hi[:, j], [0, ext[j]]]), return_inverse=True)
            weight = rng.integers(0, _PRIME, size=len(values), dtype=np.int64)
            box_terms = box_terms * ((weight[inverse[:m]] - weight[inverse[m : 2 * m]]) % _PRIME) % _PRIME
            shape_term = shape_term * int((weight[inverse[2 * m]] - weight[inverse[2 * m + 1]]) % _PRIME) % _PRIME
        if int(box_terms.sum(dtype=np.int64)) % _PRIME != shape_term:
            volume = sum(math.prod(row) for row in lengths[keep].tolist())
            return TilingProblem(
                "mismatch",
                f"the shards (split along {k} dimensions) do not tile the shape {shape}: they hold "
                f"{volume} elements of {math.prod(shape)}, some of them more than once or outside",
            )
    return None


def _box_text(offsets: np.ndarray, lengths: np.ndarray, i: int) -> str:
    return f"{tuple(int(v) for v in offsets[i])}+{tuple(int(v) for v in lengths[i])}"
