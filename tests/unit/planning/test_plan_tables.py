"""The column planner (``save_plan._plan_tables``) against the record planner
(``save_plan._plan_records``) on random jobs: the same global plan, or, where the columns leave
the common case (a rank holding one box twice, grid tilings, disagreeing ranks, bad tilings),
the records' plan or exactly their error. And the common cases do take the columns."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.errors import CheckpointError
from unickpt.planning.plan_codec import decode_local_table, encode_local_plan
from unickpt.planning.regular import regularize
from unickpt.planning.save_plan import LocalSavePlan, _plan_records, plan_save
from unickpt.planning.shard_table import ShardTable
from unickpt.planning.specs import BlobSpec, ShardSpec
from unickpt.planning.table_plan import plan_tables as _plan_tables

SETTINGS = settings(max_examples=300, deadline=None)
DTYPES = ["float32", "bfloat16", "int64", "uint8"]


def _blocks(shape: tuple[int, ...], dim: int, cuts: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    bounds = [0, *cuts, shape[dim]]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        offs = tuple(a if d == dim else 0 for d in range(len(shape)))
        lens = tuple(b - a if d == dim else shape[d] for d in range(len(shape)))
        out.append((offs, lens))
    return out


@st.composite
def jobs(draw, odd: bool = False) -> tuple[list[LocalSavePlan], int]:
    """Random jobs: 0-d, 1-d, 2-d and 3-d tensors (some empty), each whole on every rank,
    split in blocks along one dimension (replicas, sources, empty boxes), or (``odd``) split
    along two dimensions, held twice by one rank, disagreeing, or not tiled."""
    ws = draw(st.integers(1, 5))
    per_rank: list[list[ShardSpec]] = [[] for _ in range(ws)]
    for t in range(draw(st.integers(0, 5))):
        fqn = f"model.t{t}" if t % 2 else f"optimizer.state.t{t}.exp_avg"
        shape = tuple(draw(st.lists(st.integers(0 if odd else 1, 6), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        kind = draw(
            st.sampled_from(
                ["whole", "split", "split", "grid", "twice", "gap", "disagree"] if odd else ["whole", "split"]
            )
        )
        if not shape or kind == "whole" or 0 in shape or max(shape) < 2:
            boxes = [((0,) * len(shape), shape)]
        elif kind == "grid" and len(shape) >= 2 and min(shape[:2]) >= 2:
            rows = _blocks(shape, 0, [draw(st.integers(1, shape[0] - 1))])
            boxes = []
            for o, n in rows:
                for o2, n2 in _blocks(n, 1, [draw(st.integers(1, shape[1] - 1))]):
                    boxes.append((tuple(a + b for a, b in zip(o, o2)), n2))
        else:
            dim = draw(st.sampled_from([d for d in range(len(shape)) if shape[d] >= 2]))
            cuts = sorted(draw(st.sets(st.integers(1, shape[dim] - 1), min_size=1, max_size=min(3, shape[dim] - 1))))
            boxes = _blocks(shape, dim, cuts)
            if kind == "gap" and len(boxes) > 1:
                boxes = boxes[1:]
        for b, (offs, lens) in enumerate(boxes):
            holders = sorted(draw(st.sets(st.integers(0, ws - 1), min_size=1, max_size=ws)))
            source = draw(st.sampled_from([None, None, holders[0], ws - 1]))
            for r in holders:
                per_rank[r].append(ShardSpec(fqn, dtype, shape, offs, lens, source))
                if kind == "twice" and b == 0 and r == holders[0]:
                    per_rank[r].append(ShardSpec(fqn, dtype, shape, offs, lens, source))
        if kind == "disagree" and ws > 1:
            per_rank[ws - 1].append(ShardSpec(fqn, "int8", shape, (0,) * len(shape), shape))
        for r in range(ws):
            if draw(st.booleans()) and shape and shape[0] > 0 and not odd:  # an empty box of uneven sharding
                per_rank[r].append(ShardSpec(fqn, dtype, shape, (shape[0],) + (0,) * (len(shape) - 1), (0, *shape[1:])))
    plans = []
    for r in range(ws):
        shards = tuple(draw(st.permutations(per_rank[r])))
        blobs = tuple(BlobSpec(f"extra/{r}/{i}", draw(st.integers(0, 300))) for i in range(draw(st.integers(0, 2))))
        plans.append(LocalSavePlan(r, shards, blobs))
    return plans, draw(st.integers(1, 3))


def _outcome(fn, *args):
    try:
        return fn(*args)
    except CheckpointError as e:
        return (type(e), str(e))


@given(jobs())
@SETTINGS
def test_common_jobs_are_planned_on_columns_as_on_records(job):
    plans, files = job
    tables = [decode_local_table(encode_local_plan(p)) for p in plans]  # as the coordinator gets them
    fast = _plan_tables(tables, "20250101T000000-abc", files)
    if any(p.shards for p in plans):
        assert fast is not None  # the common case does take the columns
        assert fast == _plan_records(plans, "20250101T000000-abc", files)
    want = regularize(_plan_records(plans, "20250101T000000-abc", files), files)  # what plan_save adds
    assert plan_save(tables, "20250101T000000-abc", files) == want


@given(jobs(odd=True))
@SETTINGS
def test_any_job_is_planned_or_refused_as_on_records(job):
    plans, files = job
    want = _outcome(_plan_records, plans, "s", files)
    if isinstance(want, tuple):  # a refusal: never a plan from the columns
        assert _outcome(_plan_tables, [ShardTable.of(p) for p in plans], "s", files) is None
    else:  # plan_save lays split tensors out alike (planning.regular)
        want = regularize(want, files)
    assert _outcome(plan_save, plans, "s", files) == want
    assert _outcome(plan_save, [ShardTable.of(p) for p in plans], "s", files) == want


def test_a_table_planned_from_records_equals_one_from_bytes():
    plans = [
        LocalSavePlan(
            r, (ShardSpec("model.w", "float32", (4, 3), (2 * r, 0), (2, 3)), ShardSpec("s", "float32", (), (), ()))
        )
        for r in range(2)
    ]
    by_records = plan_save(plans, "s", 2)
    assert plan_save([decode_local_table(encode_local_plan(p)) for p in plans], "s", 2) == by_records
    assert {w[0]: w[3] for w in by_records.writers} == {"s": 0}  # model.w: rank r writes chunk r
    assert [entries for _, entries in by_records.layouts] == [(("model.w", 0),)]
    with pytest.raises(CheckpointError, match="in order"):
        plan_save(list(reversed(plans)), "s")


@given(
    st.lists(st.sampled_from([0, 4, 64, 4800]) | st.integers(0, 5000), max_size=120),
    st.integers(1, 5),
)
@SETTINGS
def test_lightest_first_runs_equal_the_heap_loop(sizes, parts):
    """``_lightest_first``'s slots (runs of one size) and its loop give the heap's choices."""
    import heapq

    import numpy as np

    from unickpt.planning.table_plan import _lightest_first

    ordered = sorted(sizes, reverse=True)
    heap = [(0, p) for p in range(parts)]
    want = []
    for size in ordered:
        load, p = heapq.heappop(heap)
        heapq.heappush(heap, (load + size, p))
        want.append(p)
    assert _lightest_first(np.array(ordered, dtype=np.int64), parts).tolist() == want


@given(st.lists(st.sampled_from([0, 3, 64, 100]) | st.integers(0, 500), max_size=60), st.integers(1, 4))
@SETTINGS
def test_layout_columns_equal_the_record_layout(sizes, parts):
    import numpy as np

    from unickpt.planning.save_plan import _layout, data_file_name
    from unickpt.planning.table_plan import layout_columns as _layout_columns

    work = [(n, i, "") for i, n in enumerate(sizes)]
    want = _layout("s", 3, work, parts)
    order, part, offset = _layout_columns(np.array(sizes, dtype=np.int64), parts)
    got = [
        (i, data_file_name("s", 3, p), off, sizes[i])
        for i, p, off in zip(order.tolist(), part.tolist(), offset.tolist())
    ]
    assert got == [(e.item_index, e.file, e.byte_offset, e.byte_length) for e in want]


def test_worst_fit_orders_replicated_boxes_by_fqn_then_offsets_first_dim_first():
    """Equal-sized replicated blocks of a 2x2 grid go to the lighter rank in (fqn, offsets,
    lengths) order, offsets compared from the first dimension (a tuple's order)."""
    grid = [((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]
    plans = [
        LocalSavePlan(rank, tuple(ShardSpec("model.g", "float32", (4, 4), o, n) for o, n in grid)) for rank in range(2)
    ]
    got = plan_save(plans, "s")
    assert got == _plan_records(plans, "s", 1)
    assert {w[1]: w[3] for w in got.writers} == {(0, 0): 0, (0, 2): 1, (2, 0): 0, (2, 2): 1}
