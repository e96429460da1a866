"""planning.load.shards.ShardIndex: the indexed overlap query returns exactly what a scan of every saved
shard returns, for regular and irregular layouts, stored in order or not; and plan_local_load
built on it plans the same reads as with every tensor scanned."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology
from unickpt.format.tiling import check_box_tiling
from unickpt.planning.boxes import chunk_bounds, decompose_flat_range
from unickpt.planning.load import overlap as load_overlap
from unickpt.planning.load import shards as load_shards
from unickpt.planning.load.shards import INDEX_FROM, ShardIndex, scan_overlapping
from unickpt.planning.specs import ShardSpec

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _cuts(draw, size: int, parts: int) -> list[int]:
    """Sorted cut points 0 = c0 <= ... <= c_parts = size (empty pieces allowed)."""
    inner = draw(st.lists(st.integers(0, size), min_size=parts - 1, max_size=parts - 1))
    return [0, *sorted(inner), size]


@st.composite
def row_split(draw) -> tuple[tuple[int, ...], list[Box]]:
    """FSDP / Megatron: one dimension split into torch.chunk pieces (empty trailing ones too)."""
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    dim = draw(st.integers(0, len(shape) - 1))
    parts = draw(st.integers(INDEX_FROM, 80))
    boxes = []
    for i in range(parts):
        o, n = chunk_bounds(shape[dim], parts, i)
        offs, lens = [0] * len(shape), list(shape)
        offs[dim], lens[dim] = o, n
        boxes.append((tuple(offs), tuple(lens)))
    return shape, boxes


@st.composite
def grid(draw) -> tuple[tuple[int, ...], list[Box]]:
    """An irregular 2-D / 3-D grid: every split dimension cut at its own random points."""
    shape = tuple(draw(st.lists(st.integers(1, 30), min_size=2, max_size=3)))
    cuts = [_cuts(draw, s, draw(st.integers(1, 6))) for s in shape]
    boxes: list[Box] = [((), ())]
    for c in cuts:
        boxes = [(o + (a,), n + (b - a,)) for o, n in boxes for a, b in zip(c, c[1:])]
    return shape, boxes


@st.composite
def flat(draw) -> tuple[tuple[int, ...], list[Box]]:
    """ZeRO / FSDP1: ragged contiguous row-major ranges, each split into boxes."""
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    total = math.prod(shape)
    cuts = _cuts(draw, total, draw(st.integers(2, 40)))
    boxes = []
    for a, b in zip(cuts, cuts[1:]):
        boxes += [(p.offsets, p.lengths) for p in decompose_flat_range(shape, a, b - a)]
    return shape, boxes


@st.composite
def guillotine(draw) -> tuple[tuple[int, ...], list[Box]]:
    """Brick walls and other irregular 2-D layouts: boxes cut recursively along random axes."""
    shape = (draw(st.integers(1, 24)), draw(st.integers(1, 24)))
    todo: list[Box] = [((0, 0), shape)]
    boxes: list[Box] = []
    while todo:
        offs, lens = todo.pop()
        d = draw(st.integers(0, 1))
        if lens[d] < 2 or len(boxes) + len(todo) > 60 or not draw(st.booleans()):
            boxes.append((offs, lens))
            continue
        cut = draw(st.integers(1, lens[d] - 1))
        a_len, b_off, b_len = list(lens), list(offs), list(lens)
        a_len[d], b_off[d], b_len[d] = cut, offs[d] + cut, lens[d] - cut
        todo += [(offs, tuple(a_len)), (tuple(b_off), tuple(b_len))]
    return shape, boxes


LAYOUTS = st.one_of(row_split(), grid(), flat(), guillotine())


@st.composite
def target(draw, shape: tuple[int, ...]) -> Box:
    """A box inside the shape, sticking out of it, outside it, or empty."""
    offs, lens = [], []
    for s in shape:
        o = draw(st.integers(-2, s + 1))
        offs.append(o)
        lens.append(draw(st.integers(0, s + 2 - o)))
    return tuple(offs), tuple(lens)


def _metadata(shape: tuple[int, ...], boxes: list[Box], stored_order: str, rnd) -> Metadata:
    if stored_order == "sorted":  # as format.build.build_metadata writes them
        boxes = sorted(boxes)
    elif stored_order == "shuffled":  # e.g. derived tensors, older writers
        boxes = list(boxes)
        rnd.shuffle(boxes)
    shards = tuple(ShardRecord(o, n, 0, 0, 4 * math.prod(n)) for o, n in boxes)
    return Metadata(1, "x", 0.0, Topology("t", 1), ("f",), {"w": TensorRecord("w", "float32", shape, shards)})


@settings(max_examples=examples(300), deadline=None)
@given(LAYOUTS, st.sampled_from(["sorted", "as cut", "shuffled"]), st.randoms(use_true_random=False), st.data())
def test_indexed_overlap_is_the_scan(layout, stored_order, rnd, data):
    shape, boxes = layout
    assert check_box_tiling(shape, boxes) is None  # the strategies make tilings
    if len(boxes) > 1 and data.draw(st.booleans(), "leave a gap"):  # (not valid metadata): still the scan
        del boxes[data.draw(st.integers(0, len(boxes) - 1))]
    md = _metadata(shape, boxes, stored_order, rnd)
    index = ShardIndex(md)  # one index answers many queries (its tables are built once)
    shards = md.tensors["w"].shards
    for offs, lens in data.draw(st.lists(target(shape), min_size=1, max_size=8)):
        assert index.overlapping("w", offs, lens) == scan_overlapping(shards, offs, lens)


@settings(max_examples=examples(100), deadline=None)
@given(LAYOUTS, st.sampled_from(["sorted", "shuffled"]), st.randoms(use_true_random=False), st.data())
def test_plan_local_load_is_unchanged(layout, stored_order, rnd, data):
    """The whole plan (reads, copies, order) equals the plan with every tensor scanned."""
    shape, boxes = layout
    md = _metadata(shape, boxes, stored_order, rnd)
    specs = [
        ShardSpec("w", "float32", shape, o, n)
        for o, n in data.draw(st.lists(target(shape), min_size=1, max_size=6))
        if all(a >= 0 and a + b <= s for a, b, s in zip(o, n, shape))
    ]
    indexed = load_overlap.plan_local_load(md, specs)
    old = load_shards.INDEX_FROM
    load_shards.INDEX_FROM = 10**9  # every tensor scanned (restored below; no fixture in @given)
    try:
        scanned = load_overlap.plan_local_load(md, specs)
    finally:
        load_shards.INDEX_FROM = old
    assert indexed == scanned


def test_sorted_row_split_touches_only_overlapping_shards():
    """A row split of 4,096 shards: a query reads O(log N + hits) shard records, not all."""

    class Counting(tuple):
        reads = 0

        def __getitem__(self, i):  # type: ignore[override]
            Counting.reads += 1
            return super().__getitem__(i)

    n = 4096
    boxes = [((i * 2, 0), (2, 8)) for i in range(n)]
    md = _metadata((2 * n, 8), boxes, "sorted", None)
    rec = md.tensors["w"]
    md.tensors["w"] = TensorRecord("w", rec.dtype, rec.shape, Counting(rec.shards))
    index = ShardIndex(md)
    assert index.overlapping("w", (1001, 0), (6, 8)) == [500, 501, 502, 503]
    assert Counting.reads < 40
    assert not index._tables  # no table built: the bisection found and verified the answer


def test_index_of_another_metadata_is_refused():
    md = _metadata((4,), [((0,), (4,))], "sorted", None)
    other = _metadata((4,), [((0,), (4,))], "sorted", None)
    with pytest.raises(ValueError, match="another Metadata"):
        load_overlap.plan_local_load(md, [ShardSpec("w", "float32", (4,), (0,), (4,))], ShardIndex(other))
