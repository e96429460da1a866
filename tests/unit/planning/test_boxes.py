"""Tests for unickpt.planning.boxes: N-D box geometry checked element-wise with numpy on small shapes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.format.tiling import check_box_tiling
from unickpt.planning.boxes import (
    FlatPiece,
    chunk_bounds,
    decompose_flat_range,
    intersect,
    numel,
    row_major_strides,
    sub_box_is_contiguous,
    sub_box_span,
)

SETTINGS = settings(max_examples=examples(200), deadline=None)

dims = st.integers(1, 7)
shapes = st.one_of(
    st.lists(dims, min_size=1, max_size=4).map(tuple),
    st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=1, max_size=4).map(tuple),
)


def sl(offsets, lengths):
    """numpy index for a box."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths))


@st.composite
def box_in(draw, shape):
    """A (possibly empty) box inside ``shape``."""
    offs, lens = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        offs.append(o)
        lens.append(draw(st.integers(0, d - o)))
    return tuple(offs), tuple(lens)


@st.composite
def grid(draw, shape):
    """A random grid sharding of ``shape``: every dim cut at random points."""
    per_dim = []
    for d in shape:
        cuts = sorted(draw(st.sets(st.integers(1, d - 1), max_size=3)) if d > 1 else [])
        bounds = [0, *cuts, d]
        per_dim.append([(a, b - a) for a, b in zip(bounds, bounds[1:])])
    return [(tuple(o for o, _ in combo), tuple(n for _, n in combo)) for combo in itertools.product(*per_dim)]


# --------------------------------------------------------------------------- basics


def test_numel_and_strides():
    assert numel(()) == 1
    assert numel((3, 0, 2)) == 0
    assert numel((2, 3, 4)) == 24
    assert row_major_strides(()) == ()
    assert row_major_strides((2, 3, 4)) == (12, 4, 1)
    assert row_major_strides((5,)) == (1,)


@pytest.mark.parametrize(
    "size,parts,expected",
    [
        (5, 4, [2, 2, 1, 0]),
        (6, 4, [2, 2, 2, 0]),
        (8, 4, [2, 2, 2, 2]),
        (0, 3, [0, 0, 0]),
        (1, 3, [1, 0, 0]),
        (7, 1, [7]),
        (10, 3, [4, 4, 2]),
    ],
)
def test_chunk_bounds_by_hand(size, parts, expected):
    got = [chunk_bounds(size, parts, i) for i in range(parts)]
    assert [n for _, n in got] == expected
    # starts are consecutive and clamped to size
    pos = 0
    for start, n in got:
        assert start == min(pos, size)
        pos = start + n


@given(st.integers(0, 40), st.integers(1, 9))
@SETTINGS
def test_chunk_bounds_matches_torch_chunk(size, parts):
    torch = pytest.importorskip("torch")
    ref = [len(c) for c in torch.chunk(torch.arange(size), parts)] if size else []
    ref += [0] * (parts - len(ref))
    got = [chunk_bounds(size, parts, i) for i in range(parts)]
    assert [n for _, n in got] == ref
    assert sum(n for _, n in got) == size


def test_chunk_bounds_errors():
    with pytest.raises(ValueError):
        chunk_bounds(5, 0, 0)
    with pytest.raises(ValueError):
        chunk_bounds(5, 2, 2)
    with pytest.raises(ValueError):
        chunk_bounds(5, 2, -1)
    with pytest.raises(ValueError):
        chunk_bounds(-1, 2, 0)


# --------------------------------------------------------------------------- intersect


@given(st.data(), shapes)
@SETTINGS
def test_intersect_matches_numpy_masks(data, shape):
    a = data.draw(box_in(shape))
    b = data.draw(box_in(shape))
    ma = np.zeros(shape, bool)
    mb = np.zeros(shape, bool)
    ma[sl(*a)] = True
    mb[sl(*b)] = True
    both = ma & mb
    got = intersect(*a, *b)
    if not both.any():
        assert got is None
    else:
        assert got is not None
        expect = np.zeros(shape, bool)
        expect[sl(*got)] = True
        assert np.array_equal(expect, both)
        assert all(n > 0 for n in got[1])


def test_intersect_edge_cases():
    assert intersect((), (), (), ()) == ((), ())
    assert intersect((0,), (3,), (3,), (2,)) is None  # touching, not overlapping
    assert intersect((0, 0), (0, 4), (0, 0), (4, 4)) is None  # empty box
    assert intersect((1, 1), (3, 3), (2, 0), (5, 2)) == ((2, 1), (2, 1))
    with pytest.raises(ValueError, match="rank"):
        intersect((0,), (1,), (0, 0), (1, 1))
    with pytest.raises(ValueError, match="rank"):
        intersect((0, 0), (1,), (0,), (1,))


@given(st.data(), shapes)
@SETTINGS
def test_intersect_of_a_box_with_itself_takes_the_fast_path_to_the_same_answer(data, shape):
    """Equal tuple boxes return early (a target that is exactly a saved shard); lists take the
    general path: both answers agree, for empty boxes and negative offsets too."""
    offs = tuple(data.draw(st.integers(-3, 3)) for _ in shape)
    lens = tuple(data.draw(st.integers(0, 4)) for _ in shape)
    fast = intersect(offs, lens, offs, lens)
    assert fast == intersect(list(offs), list(lens), list(offs), list(lens))
    assert fast is None or (type(fast[0]), type(fast[1])) == (tuple, tuple)
    with pytest.raises(ValueError):
        intersect(offs, (*lens[:-1], -1) if lens else (-1,), offs, (*lens[:-1], -1) if lens else (-1,))


# --------------------------------------------------------------------------- decompose_flat_range


def _check_pieces(shape, start, count, pieces):
    ndim = len(shape)
    strides = row_major_strides(shape)
    arr = np.arange(numel(shape)).reshape(shape)
    assert len(pieces) <= max(1, 2 * ndim - 1)
    pos = start
    chunks = []
    for p in pieces:
        assert isinstance(p, FlatPiece)
        assert p.flat_start == pos
        assert p.flat_start == sum(o * s for o, s in zip(p.offsets, strides))
        assert p.numel == numel(p.lengths) > 0
        vals = np.asarray(arr[sl(p.offsets, p.lengths)]).ravel()
        assert np.array_equal(vals, np.arange(p.flat_start, p.flat_start + p.numel))
        chunks.append(vals)
        pos += p.numel
    assert pos == start + count
    joined = np.concatenate(chunks) if chunks else np.array([], dtype=arr.dtype)
    assert np.array_equal(joined, np.arange(start, start + count))


def _min_pieces(shape, start, count):
    """Brute-force minimal number of contiguous boxes tiling [start, start+count) (DP)."""
    end = start + count

    def is_box(a, b):
        coords = np.array(np.unravel_index(np.arange(a, b), shape))
        return np.prod(coords.max(axis=1) - coords.min(axis=1) + 1) == b - a

    best = {end: 0}
    for p in range(end - 1, start - 1, -1):
        best[p] = min(1 + best[q] for q in range(p + 1, end + 1) if is_box(p, q))
    return best[start]


@given(st.data(), shapes)
@SETTINGS
def test_decompose_flat_range_properties(data, shape):
    total = numel(shape)
    start = data.draw(st.integers(0, total))
    count = data.draw(st.integers(0, total - start))
    pieces = decompose_flat_range(shape, start, count)
    _check_pieces(shape, start, count, pieces)
    if count == 0:
        assert pieces == []


@given(st.data(), st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple))
@settings(max_examples=examples(60), deadline=None)
def test_decompose_flat_range_is_minimal(data, shape):
    total = numel(shape)
    start = data.draw(st.integers(0, total - 1))
    count = data.draw(st.integers(1, total - start))
    pieces = decompose_flat_range(shape, start, count)
    assert len(pieces) == _min_pieces(shape, start, count)


def test_decompose_flat_range_examples():
    assert decompose_flat_range((), 0, 1) == [FlatPiece((), (), 0, 1)]
    assert decompose_flat_range((), 0, 0) == []
    assert decompose_flat_range((4, 5), 0, 20) == [FlatPiece((0, 0), (4, 5), 0, 20)]
    assert decompose_flat_range((4, 5), 3, 14) == [
        FlatPiece((0, 3), (1, 2), 3, 2),
        FlatPiece((1, 0), (2, 5), 5, 10),
        FlatPiece((3, 0), (1, 2), 15, 2),
    ]
    assert decompose_flat_range((0, 5), 0, 0) == []


def test_decompose_flat_range_worst_case_count():
    shape = (3, 4, 5, 6)
    pieces = decompose_flat_range(shape, 1, numel(shape) - 2)
    assert len(pieces) == 2 * len(shape) - 1
    _check_pieces(shape, 1, numel(shape) - 2, pieces)


def test_decompose_flat_range_errors():
    with pytest.raises(ValueError):
        decompose_flat_range((4, 5), 15, 6)
    with pytest.raises(ValueError):
        decompose_flat_range((4, 5), -1, 2)
    with pytest.raises(ValueError):
        decompose_flat_range((4, 5), 0, -1)
    with pytest.raises(ValueError):
        decompose_flat_range((), 0, 2)
    with pytest.raises(ValueError):
        decompose_flat_range((4, -5), 0, 1)


def test_decompose_flat_range_big_shape_never_enumerates_elements():
    shape = (50000, 8192)
    total = numel(shape)
    start, count = total // 3 + 17, total // 4 + 5
    pieces = decompose_flat_range(shape, start, count)
    assert len(pieces) == 3
    strides = row_major_strides(shape)
    pos = start
    for p in pieces:
        assert p.flat_start == pos == sum(o * s for o, s in zip(p.offsets, strides))
        pos += p.numel
    assert pos == start + count
    big = (1024, 1024, 1024, 1024, 1024)
    pieces = decompose_flat_range(big, 123456789, numel(big) // 2)
    assert len(pieces) <= 9
    assert sum(p.numel for p in pieces) == numel(big) // 2


# --------------------------------------------------------------------------- sub-box reads


@given(st.data(), shapes)
@SETTINGS
def test_sub_box_span_and_contiguity_match_numpy(data, shape):
    box_off = tuple(data.draw(st.integers(0, 3)) for _ in shape)
    box = (box_off, shape)  # box of `shape` placed somewhere in a larger tensor
    rel, sub_len = data.draw(box_in(shape))
    sub_off = tuple(b + r for b, r in zip(box_off, rel))
    stored = np.arange(numel(shape)).reshape(shape)
    idx = np.asarray(stored[sl(rel, sub_len)]).ravel()
    first, end = sub_box_span(*box, sub_off, sub_len)
    contiguous = sub_box_is_contiguous(shape, rel, sub_len)
    if idx.size == 0:
        assert (first, end) == (0, 0)
        assert contiguous
        return
    assert (first, end) == (idx.min(), idx.max() + 1)
    assert contiguous == (end - first == idx.size)
    assert contiguous == np.array_equal(idx, np.arange(first, end))
    # a reader fetches the run and views the sub-box with the box's strides
    run = stored.ravel()[first:end]
    strides = row_major_strides(shape)
    view = np.lib.stride_tricks.as_strided(run, shape=sub_len, strides=tuple(s * run.itemsize for s in strides))
    assert np.array_equal(view, stored[sl(rel, sub_len)])


@given(st.lists(st.integers(-1, 4), max_size=4))
@SETTINGS
def test_a_whole_box_is_contiguous_and_the_fast_path_keeps_the_errors(lengths):
    box = tuple(lengths)
    zeros = (0,) * len(box)
    if any(n < 0 for n in box):
        with pytest.raises(ValueError):
            sub_box_is_contiguous(box, zeros, box)
        return
    assert sub_box_is_contiguous(box, zeros, box)
    assert sub_box_is_contiguous(list(box), list(zeros), list(box))
    first, end = sub_box_span(zeros, box, zeros, box)
    assert end - first == (numel(box) if numel(box) else 0)


def test_sub_box_errors_and_edges():
    assert sub_box_span((), (), (), ()) == (0, 1)
    assert sub_box_is_contiguous((), (), ())
    assert sub_box_span((2, 2), (4, 5), (3, 2), (1, 5)) == (5, 10)
    with pytest.raises(ValueError, match="not inside"):
        sub_box_span((2, 2), (4, 5), (1, 2), (1, 5))
    with pytest.raises(ValueError, match="not inside"):
        sub_box_span((2, 2), (4, 5), (2, 2), (4, 6))
    with pytest.raises(ValueError, match="not inside"):
        sub_box_is_contiguous((4, 5), (0, 1), (1, 5))
    with pytest.raises(ValueError, match="rank"):
        sub_box_span((0, 0), (4, 5), (0,), (1,))
    with pytest.raises(ValueError, match="rank"):
        sub_box_is_contiguous((4, 5), (0,), (1,))


# --------------------------------------------------------------------------- tiling validation


@given(st.data(), shapes)
@SETTINGS
def test_check_box_tiling_on_grids(data, shape):
    """Grids tile; one box dropped leaves a gap at that box's first element; one box duplicated
    is reported as an overlap of exactly that box and its copy, at its first element."""
    boxes = data.draw(grid(shape))
    data.draw(st.randoms()).shuffle(boxes)
    assert check_box_tiling(shape, boxes) is None
    if len(boxes) > 1:
        k = data.draw(st.integers(0, len(boxes) - 1))
        problem = check_box_tiling(shape, boxes[:k] + boxes[k + 1 :])
        assert problem is not None and problem.kind == "gap" and problem.count == 0
        assert problem.element == boxes[k][0]
    k = data.draw(st.integers(0, len(boxes) - 1))
    problem = check_box_tiling(shape, [*boxes, boxes[k]])
    assert problem is not None and problem.kind == "overlap"
    assert problem.boxes == (k, len(boxes)) and problem.count == 2 and problem.element == boxes[k][0]


@given(st.data(), shapes)
@SETTINGS
def test_check_box_tiling_matches_brute_force(data, shape):
    """Random in-bounds boxes: the verdict matches an element count, and a problem names the
    first element (row-major order) covered other than once, how often, and boxes holding it."""
    boxes = data.draw(st.lists(box_in(shape), min_size=0, max_size=8))
    counter = np.zeros(shape, int)
    for b in boxes:
        counter[sl(*b)] += 1
    problem = check_box_tiling(shape, boxes)
    assert (problem is None) == bool((counter == 1).all())
    if problem is not None:
        first = tuple(int(i) for i in np.argwhere(counter != 1)[0])
        assert problem.element == first and problem.count == counter[first]
        assert all(intersect(*boxes[i], first, (1,) * len(shape)) is not None for i in problem.boxes)
        assert len(problem.boxes) == min(2, problem.count)


@given(st.data(), shapes)
@SETTINGS
def test_target_boxes_covered_exactly_once_by_source_intersections(data, shape):
    sources = data.draw(grid(shape))
    targets = data.draw(grid(shape))
    for t in targets:
        counter = np.zeros(shape, int)
        for s in sources:
            got = intersect(*t, *s)
            if got is not None:
                counter[sl(*got)] += 1
        inside = np.zeros(shape, bool)
        inside[sl(*t)] = True
        assert (counter[inside] == 1).all()
        assert (counter[~inside] == 0).all()


def test_check_box_tiling_edges():
    assert check_box_tiling((), [((), ())]) is None
    assert check_box_tiling((), []).kind == "gap"
    two = check_box_tiling((), [((), ()), ((), ())])
    assert two.kind == "overlap" and two.boxes == (0, 1)
    # out of bounds never covers, even when the sizes add up
    assert check_box_tiling((4,), [((0,), (2,)), ((3,), (2,))]).kind == "outside"
    assert check_box_tiling((4,), [((-1,), (2,)), ((1,), (3,))]).kind == "outside"
    assert check_box_tiling((4,), [((0,), (4,)), ((0,), (-1,))]).kind == "outside"
    # empty boxes are ignored
    assert check_box_tiling((4,), [((0,), (4,)), ((2,), (0,))]) is None
    assert check_box_tiling((0, 3), [((0, 0), (0, 3))]) is None
    with pytest.raises(ValueError, match="rank"):
        check_box_tiling((4, 4), [((0,), (4,))])


def test_check_box_tiling_large_grids():
    # 1-D split along the inner dim only
    boxes = [((0, i * 8), (4096, 8)) for i in range(5000)]
    assert check_box_tiling((4096, 40000), boxes) is None
    boxes = [((i * 10, j * 10), (10, 10)) for i in range(100) for j in range(100)]
    assert check_box_tiling((1000, 1000), boxes) is None
    problem = check_box_tiling((1000, 1000), boxes + boxes)
    assert problem is not None and problem.kind == "overlap" and problem.boxes == (0, 10000)
