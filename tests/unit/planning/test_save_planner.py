"""The save planner (``plan.plan_save``, one driver on rank groups) gives the record planner's
plan (``tests.support.save_oracle``, the reference), on random jobs (hypothesis):
- every job (a rank holding one box twice, grid tilings, blobs only), or exactly the oracle's
  error (disagreeing ranks, bad tilings), planned on groups (``templates.RegularRankPlans``);
- regular jobs mixing tensors every rank holds one ``torch.chunk`` of (with empty tails),
  replicated tensors and 0-d steps (some with a named replica source), rank-0-only tensors,
  per-rank blobs and per-rank spec orders, entry for entry; its lazy rank plans give the same
  columns, explicit entries and file sizes as the tuple they stand for; a DDP-like job (no split
  tensor) and one whose split layout would leave a rank without a file (then fewer tensors
  split), a tensor chunked on some ranks only (then explicit), a chunk another rank holds too
  (split as its writers say), a box held twice by one rank, a job of many groups;
- the layout rules on columns equal their plain loops."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from tests.support.save_oracle import layout as _layout
from tests.support.save_oracle import outcome as _outcome
from tests.support.save_oracle import plan_records as _plan_records
from tests.support.save_oracle import regularize
from unickpt.errors import CheckpointError
from unickpt.planning.save.model import GlobalSavePlan, LocalSavePlan, rank_plan_rows
from unickpt.planning.save.plan import plan_save
from unickpt.planning.save.table import ShardTable
from unickpt.planning.save.templates import RegularRankPlans, chunk_rule
from unickpt.planning.save.wire import (
    LocalPlans,
    decode_local_table,
    decode_rank_plan,
    encode_local_plan,
    encode_rank_rows,
)
from unickpt.planning.specs import BlobSpec, ShardSpec

COLUMN_SETTINGS = settings(max_examples=examples(300), deadline=None)
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
def column_jobs(draw, odd: bool = False) -> tuple[list[LocalSavePlan], int]:
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


@given(column_jobs())
@COLUMN_SETTINGS
def test_common_jobs_are_planned_on_columns_as_on_records(job):
    plans, files = job
    tables = [decode_local_table(encode_local_plan(p)) for p in plans]  # as the coordinator gets them
    want = regularize(_plan_records(plans, "20250101T000000-abc", files), files)  # split tensors laid out alike
    assert plan_save(tables, "20250101T000000-abc", files) == want


@given(column_jobs(odd=True))
@COLUMN_SETTINGS
def test_any_job_is_planned_or_refused_as_on_records(job):
    plans, files = job
    want = _outcome(_plan_records, plans, "s", files)
    if not isinstance(want, tuple):  # split tensors laid out alike (planning.save.split)
        want = regularize(want, files)
    assert _outcome(plan_save, [ShardTable.of(p) for p in plans], "s", files) == want  # plan or refusal
    assert _outcome(plan_save, plans, "s", files) == want


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
@COLUMN_SETTINGS
def test_lightest_first_runs_equal_the_heap_loop(sizes, parts):
    """``_lightest_first``'s slots (runs of one size) and its loop give the heap's choices."""
    import heapq

    import numpy as np

    from unickpt.planning.save.layout import _lightest_first

    ordered = sorted(sizes, reverse=True)
    heap = [(0, p) for p in range(parts)]
    want = []
    for size in ordered:
        load, p = heapq.heappop(heap)
        heapq.heappush(heap, (load + size, p))
        want.append(p)
    assert _lightest_first(np.array(ordered, dtype=np.int64), parts).tolist() == want


@given(
    st.lists(st.sampled_from([0, 4, 64, 4800]) | st.integers(0, 5000), max_size=120),
    st.lists(st.integers(0, 9000), min_size=1, max_size=5),
)
@COLUMN_SETTINGS
def test_lightest_first_from_loads_equals_the_heap_loop(sizes, loads):
    """Starting from parts that already hold bytes (a rank's split chunks), the runs give the
    heap's choices too."""
    import heapq

    import numpy as np

    from unickpt.planning.save.layout import _lightest_first

    ordered = sorted(sizes, reverse=True)
    heap = [(load, p) for p, load in enumerate(loads)]
    heapq.heapify(heap)
    want = []
    for size in ordered:
        load, p = heapq.heappop(heap)
        heapq.heappush(heap, (load + size, p))
        want.append(p)
    got = _lightest_first(np.array(ordered, dtype=np.int64), len(loads), np.array(loads, dtype=np.int64))
    assert got.tolist() == want


@given(st.lists(st.sampled_from([0, 3, 64, 100]) | st.integers(0, 500), max_size=60), st.integers(1, 4))
@COLUMN_SETTINGS
def test_layout_columns_equal_the_record_layout(sizes, parts):
    import numpy as np

    from unickpt.planning.save.layout import lay_out_rank as _layout_columns
    from unickpt.planning.save.model import file_name

    work = [(n, i, "") for i, n in enumerate(sizes)]
    want = _layout("s", 3, work, parts)
    order, part, offset = _layout_columns(np.array(sizes, dtype=np.int64), parts)
    got = [(i, file_name(3, p), off, sizes[i]) for i, p, off in zip(order.tolist(), part.tolist(), offset.tolist())]
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


# ---------------------------------------------------------------- regular jobs: templates

REGULAR_SETTINGS = settings(max_examples=examples(150), deadline=None, derandomize=True, database=None)
SAVE_ID = "20250101T000000-0123456789ab"


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    c = -(-n // parts)
    lo = min(n, i * c)
    return lo, min(n, lo + c) - lo


@st.composite
def regular_jobs(draw, partial: bool = False):
    world = draw(st.integers(2, 9))
    specs: list[list[ShardSpec]] = [[] for _ in range(world)]
    kinds = ["split", "split", "replicated", "step", "rank0"] + (["part-of-job"] if partial else [])
    for t in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(kinds))
        shape = (draw(st.integers(1, 2 * world + 3)), draw(st.integers(1, 3)))
        d = draw(st.integers(0, 1))
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int64"]))
        source = draw(st.sampled_from([None, None, 0, world - 1]))
        fqn = f"model.t{t}"
        for r in range(world):
            if kind in ("split", "part-of-job"):
                parts = world if kind == "split" else max(1, world // 2)
                if kind == "part-of-job" and r >= parts:
                    continue
                lo, n = _chunk(shape[d], parts, r)
                offs = tuple(lo if i == d else 0 for i in range(2))
                lens = tuple(n if i == d else shape[i] for i in range(2))
                specs[r].append(ShardSpec(fqn, dtype, shape, offs, lens))
            elif kind == "replicated":
                specs[r].append(ShardSpec(fqn, dtype, shape, (0, 0), shape, source))
            elif kind == "step":
                specs[r].append(ShardSpec(fqn, "float32", (), (), (), source))
            else:  # rank 0 holds all of it, the others an empty box
                lens = shape if r == 0 else (0, shape[1])
                specs[r].append(ShardSpec(fqn, dtype, shape, (0, 0), lens))
    plans = []
    shuffle = draw(st.booleans())
    for r in range(world):
        shards = draw(st.permutations(specs[r])) if shuffle else specs[r]
        blobs = tuple(
            BlobSpec(f"loader/{r}/{i}", draw(st.sampled_from([0, 7, 64, 300]))) for i in range(draw(st.integers(0, 2)))
        )
        plans.append(LocalSavePlan(r, tuple(shards), blobs))
    return plans, draw(st.integers(1, 3))


def _reference(plans: list[LocalSavePlan], files: int) -> GlobalSavePlan:
    return regularize(_plan_records(plans, SAVE_ID, files), files)


def _same(a: GlobalSavePlan, b: GlobalSavePlan) -> None:
    assert a.save_id == b.save_id
    assert a.tensors == b.tensors and list(a.tensors) == list(b.tensors)
    assert a.files == b.files
    assert a.layouts == b.layouts
    assert a.writers == b.writers
    assert list(a.rank_plans) == list(b.rank_plans)


@given(regular_jobs())
@REGULAR_SETTINGS
def test_regular_jobs_are_planned_as_by_the_record_planner(job):
    plans, files = job
    want = _reference(plans, files)
    got = plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, files)
    assert isinstance(got.rank_plans, RegularRankPlans)
    _same(got, want)
    # the lazy plans give what the tuple gives: columns, the bytes a rank receives, entries, sizes
    for r, rp in enumerate(want.rank_plans):
        files_r, rows, blobs = got.rank_rows(r)
        w_files, w_rows, w_blobs = rank_plan_rows(rp)
        assert (files_r, rows.tolist(), blobs) == (w_files, w_rows.tolist(), w_blobs)
        assert decode_rank_plan(encode_rank_rows(r, SAVE_ID, files_r, rows, blobs)) == rp

    def where(x):
        return x[0], x[1].file, x[1].byte_offset

    assert sorted(got.explicit_entries(), key=where) == sorted(
        (
            (rank, e)
            for rank, e in want.explicit_entries()
            if e.blob_key or _outside_layouts(want, rank, e.item_index, plans)
        ),
        key=where,
    )
    assert got.file_ends() == want.file_ends()
    other = got.with_save_id("20250101T000000-feedfacecafe")  # plans name files by (rank, part)
    assert [rp.save_id for rp in other.rank_plans] == ["20250101T000000-feedfacecafe"] * len(plans)
    assert [rp.entries for rp in other.rank_plans] == [rp.entries for rp in want.rank_plans]


def _outside_layouts(g: GlobalSavePlan, rank: int, item: int, plans: list[LocalSavePlan]) -> bool:
    split = {fqn for _files, entries in g.layouts for fqn, _ in entries}
    return plans[rank].shards[item].fqn not in split


@given(regular_jobs(partial=True))
@REGULAR_SETTINGS
def test_every_job_gets_the_record_planners_plan(job):
    """Jobs with tensors split over part of the job fall through; plan_save's plan is the
    reference's in every case."""
    plans, files = job
    want = _reference(plans, files)  # the oracle, once
    _same(plan_save(plans, SAVE_ID, files), want)
    _same(plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, files), want)


@given(
    extent=st.integers(0, 40),
    world=st.integers(2, 50),
    other=st.integers(0, 4),
    d=st.integers(0, 1),
)
@settings(max_examples=examples(300), deadline=None)
def test_chunk_rule_matches_torch_chunk_parts_only(extent, world, other, d):
    """Row r is ruled along d exactly when its box is torch.chunk part r (torch's sizes, computed
    here), the other dimension whole and part 0 not the whole extent."""
    import torch

    shape = (extent, other) if d == 0 else (other, extent)
    pieces = torch.chunk(torch.arange(extent), world) if extent else ()
    for r in range(world):
        lo = sum(len(p) for p in pieces[:r]) if r < len(pieces) else extent
        n = len(pieces[r]) if r < len(pieces) else 0
        offs = tuple(lo if i == d else 0 for i in range(2))
        lens = tuple(n if i == d else shape[i] for i in range(2))
        full = (tuple(0 for _ in shape), shape)
        table = ShardTable.of(
            LocalSavePlan(r, (ShardSpec("t", "float32", shape, offs, lens), ShardSpec("u", "float32", shape, *full)))
        )
        rule = chunk_rule(table, world).tolist()
        part0_whole = not pieces or len(pieces[0]) == extent
        assert rule == [-1 if part0_whole else d, -1], (shape, r, offs, lens)


@pytest.mark.parametrize(
    "world",
    [pytest.param(1000, marks=pytest.mark.slow, id="1000"), pytest.param(64, id="64")],  # 1,000: seconds of oracle
)
def test_a_fsdp_like_job_of_many_ranks_is_one_template(world):
    """1,000 ranks (64 in the fast tier), each chunk r of 50 tensors plus 50 replicated steps: one
    template, every rank's part computed when asked, the steps given by worst-fit as the record
    planner gives them (to the lightest rank: the last, whose chunks are short)."""
    plans = []
    for r in range(world):
        specs = []
        for i in range(50):
            rows = world * (4 + i) - i % 3  # every rank's chunk has rows, the last a few fewer
            lo, n = _chunk(rows, world, r)
            specs.append(ShardSpec(f"model.w{i}", "bfloat16", (rows, 8), (lo, 0), (n, 8)))
            specs.append(ShardSpec(f"optim.step{i}", "float32", (), (), ()))
        plans.append(LocalSavePlan(r, tuple(specs)))
    g = plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, 2)
    assert isinstance(g.rank_plans, RegularRankPlans)
    assert len(set(g.rank_plans.template_of.tolist())) == 1
    assert sorted(w[0] for w in g.writers) == sorted(f"optim.step{i}" for i in range(50))
    assert [w[:4] for w in g.writers] == [w[:4] for w in _reference(plans[:], 2).writers]


def test_a_ddp_like_job_is_one_template():
    """Whole tensors on every rank (one with a named replica source) and per-rank blobs, no
    split tensor: one template, planned lazily by the templates, the record planner's plan."""
    plans = [
        LocalSavePlan(
            r,
            (
                ShardSpec("model.w", "float32", (16, 4), (0, 0), (16, 4)),
                ShardSpec("model.b", "bfloat16", (4,), (0,), (4,), 0),
                ShardSpec("optim.step", "float32", (), (), ()),
            ),
            (BlobSpec(f"loader/{r}", 100 + r),),
        )
        for r in range(6)
    ]
    for files in (1, 2):
        g = plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, files)
        assert isinstance(g.rank_plans, RegularRankPlans)
        assert len(set(g.rank_plans.template_of.tolist())) == 1
        assert g.layouts == ()
        _same(g, _reference(plans, files))


def test_a_rank_without_a_layout_file_keeps_only_full_split_tensors():
    """Four ranks, two files: ``a`` (3 rows: rank 3's chunk is empty) and ``b`` (8 rows) split,
    ``b``'s chunk 0 larger, so ``a`` alone gets part 1, which rank 3 would not write. The
    templates then split only ``b``, as the record planner does, instead of giving up."""
    world = 4
    plans = []
    for r in range(world):
        a_lo, a_n = _chunk(3, world, r)
        b_lo, b_n = _chunk(8, world, r)
        plans.append(
            LocalSavePlan(
                r,
                (
                    ShardSpec("a", "float32", (3, 1), (a_lo, 0), (a_n, 1)),
                    ShardSpec("b", "float32", (8, 4), (b_lo, 0), (b_n, 4)),
                ),
            )
        )
    want = _reference(plans, 2)
    assert [[fqn for fqn, _ in entries] for _files, entries in want.layouts] == [["b"]]
    g = plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, 2)
    assert isinstance(g.rank_plans, RegularRankPlans)
    _same(g, want)


def test_a_tensor_chunked_on_some_ranks_only_is_planned_with_explicit_boxes():
    """Two ranks: ``a`` (4 rows) is chunk 0 on rank 0 but rows 2 and 3 apart on rank 1 (no
    rank's chunk), ``b`` is chunk r on rank r. The templates split ``b`` only and write ``a``'s
    boxes as rows, the record planner's plan, instead of giving up."""
    plans = [
        LocalSavePlan(
            0,
            (
                ShardSpec("a", "float32", (4, 2), (0, 0), (2, 2)),
                ShardSpec("b", "int64", (4,), (0,), (2,)),
            ),
        ),
        LocalSavePlan(
            1,
            (
                ShardSpec("a", "float32", (4, 2), (2, 0), (1, 2)),
                ShardSpec("a", "float32", (4, 2), (3, 0), (1, 2)),
                ShardSpec("b", "int64", (4,), (2,), (2,)),
            ),
        ),
    ]
    for files in (1, 2):
        want = _reference(plans, files)
        assert [fqn for _files, entries in want.layouts for fqn, _ in entries] == ["b"]
        g = plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, files)
        assert isinstance(g.rank_plans, RegularRankPlans)
        _same(g, want)


def test_a_rank_holding_a_box_twice_is_one_holder_in_the_templates():
    """Three ranks hold ``w`` whole, rank 1 twice; ``b`` is chunk r on rank r: the templates
    plan it (one writer of ``w``), the record planner's plan."""
    plans = []
    for r in range(3):
        w = ShardSpec("w", "float32", (5, 3), (0, 0), (5, 3))
        lo, n = _chunk(6, 3, r)
        b = ShardSpec("b", "float32", (6, 2), (lo, 0), (n, 2))
        plans.append(LocalSavePlan(r, (w, b, w) if r == 1 else (w, b)))
    for files in (1, 2):
        g = plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, files)
        assert isinstance(g.rank_plans, RegularRankPlans)
        assert [w[0] for w in g.writers] == ["w"]
        _same(g, _reference(plans, files))


# ---------------------------------------------------------------- one driver: every job on rank groups


@given(st.one_of(column_jobs(odd=True), regular_jobs(partial=True)))
@settings(max_examples=examples(60), deadline=None, derandomize=True, database=None)
def test_every_job_is_planned_on_rank_groups_or_refused(job):
    """No second planner: every job (irregular, disagreeing, split over part of the job) is
    planned on rank groups, its rank plans computed when asked, or refused; the plan or the
    refusal is the record planner's."""
    plans, files = job
    want = _outcome(_plan_records, plans, "s", files)
    got = _outcome(plan_save, LocalPlans([encode_local_plan(p) for p in plans]), "s", files)
    if isinstance(want, tuple):
        assert got == want
        return
    assert isinstance(got.rank_plans, RegularRankPlans)
    assert got == regularize(want, files)


def _two_ranks_chunked(extra: ShardSpec, *, twice: bool = False) -> list[LocalSavePlan]:
    """Rank r holds chunk r of ``a`` (4 x 2); rank 1 also holds ``extra`` (and, ``twice``, its
    own chunk a second time)."""
    chunks = [ShardSpec("a", "float32", (4, 2), (2 * r, 0), (2, 2)) for r in range(2)]
    return [LocalSavePlan(0, (chunks[0],)), LocalSavePlan(1, (chunks[1], extra, *((chunks[1],) if twice else ())))]


@pytest.mark.parametrize("case", ["named-source", "balanced", "twice"])
def test_a_chunk_another_rank_holds_too_is_split_as_its_writers_say(case):
    """Writers are chosen before the split is decided: chunk 0 of ``a`` also held by rank 1 is
    written by rank 1 when it names itself the source (``a`` is then no split tensor), by the
    lighter rank 0 when nobody does (then split); a rank holding its own chunk twice is one
    holder (split). The record planner's plan in each case, on rank groups."""
    extra = ShardSpec("a", "float32", (4, 2), (0, 0), (2, 2), 1 if case == "named-source" else None)
    plans = _two_ranks_chunked(extra, twice=case == "twice")
    for files in (1, 2):
        want = _reference(plans, files)
        split = [fqn for _files, entries in want.layouts for fqn, _ in entries]
        assert ("a" in split) == (case != "named-source")
        g = plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, files)
        assert isinstance(g.rank_plans, RegularRankPlans)
        _same(g, want)


def test_a_job_of_many_groups_is_planned_on_groups():
    """100 ranks, each holding an uneven block of ``w`` (no rank's ``torch.chunk``) and a
    replicated step and bias: one group per rank, the record planner's plan."""
    world, cuts = 100, [0]
    for r in range(world):
        cuts.append(cuts[-1] + 1 + r % 7)
    plans = [
        LocalSavePlan(
            r,
            (
                ShardSpec("w", "bfloat16", (cuts[-1], 3), (cuts[r], 0), (cuts[r + 1] - cuts[r], 3)),
                ShardSpec("step", "float32", (), (), ()),
                ShardSpec("bias", "float32", (5,), (0,), (5,), 0 if r % 2 else None),
            ),
            (BlobSpec(f"rng/{r}", 16 + r),),
        )
        for r in range(world)
    ]
    for files in (1, 2):
        g = plan_save(LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, files)
        assert isinstance(g.rank_plans, RegularRankPlans)
        assert len(set(g.rank_plans.template_of.tolist())) == world
        _same(g, _reference(plans, files))


def test_a_table_naming_a_tensor_no_row_uses_is_planned_as_its_records():
    """Decoded tables may list a name no row uses (here one rank has no rows at all): the plan
    is the one of the records those tables stand for."""
    import numpy as np

    real = [ShardTable.of(LocalSavePlan(0, (ShardSpec("w", "int64", (2,), (0,), (2,)),), (BlobSpec("b0", 10),)))]
    none, flat = np.zeros(0, dtype=np.int64), np.zeros((0, 1), dtype=np.int64)
    real.append(
        ShardTable(1, ("ghost", "w"), ("float32",), none, none, none, none, flat, flat, flat, (BlobSpec("b1", 7),))
    )
    want = _reference([t.to_plan() for t in real], 2)
    _same(plan_save(real, SAVE_ID, 2), want)
    ghosts = [ShardTable(r, ("ghost",), ("float32",), none, none, none, none, flat, flat, flat) for r in range(2)]
    _same(plan_save(ghosts, SAVE_ID, 2), _reference([t.to_plan() for t in ghosts], 2))


def test_refusals_of_grouped_ranks_are_worded_rank_by_rank():
    """Eight ranks in two groups: ranks 4-7 disagree on ``s``'s dtype (each named, in rank
    order), or every rank holds the same half of ``h`` (the gap named once): the record
    planner's refusal, word for word."""
    for case in ("disagree", "gap"):
        plans = []
        for r in range(8):
            lo, n = _chunk(16, 8, r)
            specs = [ShardSpec("w", "float32", (16, 2), (lo, 0), (n, 2))]
            specs.append(ShardSpec("s", "int64" if case == "disagree" and r >= 4 else "float32", (), (), ()))
            if case == "gap":
                specs.append(ShardSpec("h", "float32", (4,), (0,), (2,)))
            plans.append(LocalSavePlan(r, tuple(specs)))
        want = _outcome(_plan_records, plans, SAVE_ID, 2)
        assert isinstance(want, tuple)
        assert _outcome(plan_save, LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, 2) == want


@given(
    st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40), st.integers(0, 2)), max_size=8),
    st.integers(1, 12),
)
@settings(max_examples=examples(200), deadline=None)
def test_chunk_sums_equal_the_per_rank_loop(tensors, world):
    """Each rank's chunk bytes per part, aligned bytes and whether it holds any, summed over the
    ranks' ``torch.chunk`` rows (computed here per rank), without a (ranks, tensors) array."""
    import numpy as np

    from unickpt.planning.save.plan import _chunk_sums

    parts = 3
    loads = [[0] * parts for _ in range(world)]
    ends = [[0] * parts for _ in range(world)]
    uses = [[False] * parts for _ in range(world)]
    for extent, row_bytes, part in tensors:
        for r in range(world):
            _, n = _chunk(extent, world, r)
            loads[r][part] += n * row_bytes
            ends[r][part] += -(-n * row_bytes // 64) * 64
            uses[r][part] |= n > 0
    extent, row_bytes, part = (np.array([t[k] for t in tensors], dtype=np.int64) for k in range(3))
    got = _chunk_sums(extent, -(-extent // world), row_bytes, part, parts, world) if tensors else None
    if got is not None:
        assert (got[0].tolist(), got[1].tolist(), got[2].tolist()) == (loads, ends, uses)
