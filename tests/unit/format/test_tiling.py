"""format.tiling: the one check (metadata decoder and save planner) that boxes tile a tensor.

Checked against a brute-force element count on small shapes (random boxes with gaps, overlaps,
out-of-bounds and empty boxes, 0-d tensors), on its randomised path for layouts split along many
dimensions, and for its cost: the work of decoding a crafted staircase tiling grows linearly with
the number of shards (counted in executed Python lines, never in seconds).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.format_sums import chunk_sums
from tests.support.hypothesis_profiles import examples
from unickpt.errors import CorruptMetadataError, PlanningError
from unickpt.format import tiling
from unickpt.format.codec import decode_metadata, encode_metadata
from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology
from unickpt.format.tiling import check_box_tiling
from unickpt.planning.save import LocalSavePlan, plan_save
from unickpt.planning.specs import ShardSpec

SETTINGS = settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)

Box = tuple[tuple[int, ...], tuple[int, ...]]


def coverage(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray | None:
    """How often each element is covered, or None if some box has a negative length or pokes
    outside the shape (the oracle: plain element counting, no cleverness)."""
    counts = np.zeros(shape, dtype=int)
    for offs, lens in boxes:
        if any(n < 0 or o < 0 or o + n > s for o, n, s in zip(offs, lens, shape)):
            return None
        counts[tuple(slice(o, o + n) for o, n in zip(offs, lens))] += 1
    return counts


@st.composite
def box_sets(draw: Callable[..., Any]) -> tuple[tuple[int, ...], list[Box]]:
    """A shape of 0..3 dims (sizes 0..4) and boxes: random ones, or a random tiling (recursive
    splits), then maybe broken (a box dropped, duplicated, shifted, or a random box added)."""
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    coord = st.integers(-1, 5)
    if draw(st.booleans()):
        n = draw(st.integers(0, 6))
        return shape, [(tuple(draw(coord) for _ in shape), tuple(draw(coord) for _ in shape)) for _ in range(n)]
    boxes: list[Box] = []

    def split(offs: tuple[int, ...], lens: tuple[int, ...], depth: int) -> None:
        cuttable = [d for d, n in enumerate(lens) if n >= 2]
        if not cuttable or depth > 4 or not draw(st.booleans()):
            boxes.append((offs, lens))
            return
        d = draw(st.sampled_from(cuttable))
        c = draw(st.integers(1, lens[d] - 1))
        split(offs, (*lens[:d], c, *lens[d + 1 :]), depth + 1)
        split((*offs[:d], offs[d] + c, *offs[d + 1 :]), (*lens[:d], lens[d] - c, *lens[d + 1 :]), depth + 1)

    split((0,) * len(shape), shape, 0)
    change = draw(st.sampled_from(["none", "drop", "dup", "shift", "add", "empty"]))
    i = draw(st.integers(0, len(boxes) - 1))
    if change == "drop":
        boxes.pop(i)
    elif change == "dup":
        boxes.append(boxes[i])
    elif change == "shift" and shape:
        d = draw(st.integers(0, len(shape) - 1))
        offs, lens = boxes[i]
        boxes[i] = ((*offs[:d], offs[d] + draw(st.sampled_from([-1, 1])), *offs[d + 1 :]), lens)
    elif change == "add":
        boxes.insert(i, (tuple(draw(coord) for _ in shape), tuple(draw(coord) for _ in shape)))
    elif change == "empty" and shape:
        offs = tuple(draw(st.integers(0, s)) for s in shape)
        boxes.insert(i, (offs, (0,) + tuple(s - o for s, o in zip(shape[1:], offs[1:]))))
    return shape, boxes


def assert_matches_oracle(shape: tuple[int, ...], boxes: list[Box], exact: bool) -> None:
    problem = check_box_tiling(shape, boxes)
    counts = coverage(shape, boxes)
    if counts is None:
        bad = next(i for i, (o, n) in enumerate(boxes) if coverage(shape, [(o, n)]) is None)
        assert problem is not None and problem.kind == "outside" and problem.boxes == (bad,), (shape, boxes, problem)
        return
    tiles = bool((counts == 1).all())
    assert (problem is None) == tiles, (shape, boxes, problem)
    if tiles or not exact:
        assert problem is None or problem.kind == "mismatch"
        return
    first = tuple(int(i) for i in np.argwhere(counts != 1)[0])  # row-major first element
    assert problem.element == first and problem.count == counts[first], (shape, boxes, problem)
    assert problem.kind == ("gap" if problem.count == 0 else "overlap")
    assert len(problem.boxes) == min(2, problem.count)
    for i in problem.boxes:
        assert coverage(shape, [boxes[i]])[first] == 1  # each named box holds the element
    if problem.run is not None:  # the reported run is covered exactly as often
        d, start, end = problem.run
        assert start == first[d] < end <= shape[d]
        line = list(first)
        for x in range(start, end):
            line[d] = x
            assert counts[tuple(line)] == problem.count
        assert f"[{start}, {end}) of dimension {d}" in str(problem)


@SETTINGS
@given(box_sets())
def test_tiling_check_matches_element_count(case):
    """The exact path: verdict, first badly covered element, its count, the boxes holding it."""
    assert_matches_oracle(*case, exact=True)


@SETTINGS
@given(box_sets())
def test_randomised_path_matches_element_count(case):
    """The path for layouts split along many dimensions (forced here by a zero corner budget):
    never refuses a tiling, always (with overwhelming probability) finds a non-tiling."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiling, "CORNER_CELLS", 0)
        assert_matches_oracle(*case, exact=False)


def test_many_split_dimensions_take_the_randomised_path():
    """A 14-D tensor cut in two along every dimension (16384 unit boxes: too many corners to
    list) is accepted; with one box missing or doubled it is refused, without a location."""
    shape = (2,) * 14
    boxes = [(offs, (1,) * 14) for offs in itertools.product((0, 1), repeat=14)]
    assert check_box_tiling(shape, boxes) is None
    for broken in (boxes[:-1], [*boxes, boxes[5]]):
        problem = check_box_tiling(shape, broken)
        assert problem is not None and problem.kind == "mismatch" and "split along 14 dimensions" in str(problem)
    # unsplit dimensions cost nothing: the same boxes with 20 whole dimensions added stay exact
    wide = [((a, b) + (0,) * 20, (1, 1) + (3,) * 20) for a in (0, 1) for b in (0, 1)]
    assert check_box_tiling((2, 2) + (3,) * 20, wide) is None
    problem = check_box_tiling((2, 2) + (3,) * 20, wide[:3])
    assert problem.kind == "gap" and problem.element == (1, 1) + (0,) * 20


# --------------------------------------------------------------------------- decode and plan


def staircase(n: int) -> tuple[tuple[int, int], list[Box]]:
    """A crafted tiling of (m, m), m = (n + 1) // 2: column i split at row i. Every row slab
    crosses all m columns, which made the old recursive sweep quadratic."""
    m = (n + 1) // 2
    boxes: list[Box] = []
    for i in range(m):
        if i:
            boxes.append(((0, i), (i, 1)))
        boxes.append(((i, i), (m - i, 1)))
    return (m, m), boxes


def metadata_bytes(shape: tuple[int, ...], boxes: list[Box]) -> bytes:
    shards, offset = [], 0
    for offs, lens in boxes:
        nbytes = math.prod(lens) * 4
        shards.append(ShardRecord(offs, lens, 0, offset, nbytes))
        offset += nbytes
    rec = TensorRecord("w", "float32", shape, tuple(shards))
    files = ("data/s/r00000-00.bin",)
    return encode_metadata(
        Metadata(1, "s", 0.0, Topology("torch", 1), files, {"w": rec}, checksums=chunk_sums(files, [rec]))
    )


def executed_lines(fn: Callable[[], Any]) -> int:
    """Python lines executed by ``fn()`` (every frame, loop bodies once per iteration)."""
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    sys.settrace(lambda frame, event, arg: local)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_item10_tiling_check_work_is_linear_in_shards():
    """Issue 9 item 10: decoding (and planning) a staircase tiling of 4x more shards executes
    about 4x more Python lines (the old sweep: 16x, 3.7 s at 1,000 shards, 79 s at 4,000)."""
    small, large = staircase(300), staircase(1200)
    data_small, data_large = metadata_bytes(*small), metadata_bytes(*large)
    ratio = executed_lines(lambda: decode_metadata(data_large)) / executed_lines(lambda: decode_metadata(data_small))
    assert ratio < 6, f"decode work grew {ratio:.1f}x for 4x the shards"

    def plan(case: tuple[tuple[int, int], list[Box]]) -> Callable[[], Any]:
        shape, boxes = case
        specs = tuple(ShardSpec("w", "float32", shape, o, n) for o, n in boxes)
        return lambda: plan_save([LocalSavePlan(0, specs)], "s")

    ratio = executed_lines(plan(large)) / executed_lines(plan(small))
    assert ratio < 6, f"planning work grew {ratio:.1f}x for 4x the shards"


def test_staircase_decodes_and_a_missing_shard_is_located():
    """20,000 shards in the crafted staircase decode; with shard 9,001 (rows [4501, 10000) of
    column 4501) gone, the error names the first uncovered element and the run from it."""
    shape, boxes = staircase(20000)
    md = decode_metadata(metadata_bytes(shape, boxes))
    assert len(md.tensors["w"].shards) == len(boxes)
    assert boxes[9000] == ((4500, 4500), (5500, 1))
    with pytest.raises(CorruptMetadataError) as ei:
        decode_metadata(metadata_bytes(shape, boxes[:9000] + boxes[9001:]), "ck/unickpt.metadata.json")
    msg = str(ei.value)
    assert "tensor 'w': the shards do not cover the shape (10000, 10000)" in msg
    assert "elements [4500, 4501) of dimension 1 are not saved (from element (4500, 4500))" in msg
    assert "ck/unickpt.metadata.json" in msg


def test_codec_and_planner_report_the_same_problem():
    """One algorithm: the planner's PlanningError and the decoder's CorruptMetadataError carry
    the same sentence for the same overlapping boxes."""
    shape, boxes = staircase(99)
    boxes = [*boxes, ((3, 3), (2, 2))]
    with pytest.raises(PlanningError) as planned:
        plan_save([LocalSavePlan(0, tuple(ShardSpec("w", "float32", shape, o, n) for o, n in boxes))], "s")
    with pytest.raises(CorruptMetadataError) as decoded:
        decode_metadata(metadata_bytes(shape, boxes))
    sentence = "shards (3, 3)+(47, 1) and (3, 3)+(2, 2) overlap: elements [3, 4) of dimension 1"
    assert sentence in str(planned.value) and sentence in str(decoded.value)


def test_json_rows_and_binary_table_agree():
    """Below 64 shards the rows are JSON lists, from 64 on a binary table: same verdicts."""
    for n in (9, 63, 64, 65, 201):
        shape, boxes = staircase(n)
        decode_metadata(metadata_bytes(shape, boxes))
        doc = json.loads(metadata_bytes(shape, boxes[1:]))
        assert ("shards" in doc["tensors"]["w"]) == (len(boxes) - 1 < 64)
        with pytest.raises(CorruptMetadataError, match="not saved"):
            decode_metadata(json.dumps(doc).encode())
