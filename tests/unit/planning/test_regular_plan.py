"""The planner of regular jobs (``planning.regular_plan``): on random jobs mixing tensors every
rank holds one ``torch.chunk`` of (with empty tails), replicated tensors and 0-d steps (some
with a named replica source), rank-0-only tensors, per-rank blobs and per-rank spec orders, its
plan equals the record planner's (then ``regularize``), entry for entry; its lazy rank plans
give the same columns, explicit entries and file sizes as the tuple they stand for; and jobs it
must not plan (a tensor split over part of the job) fall through to the other planners."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.planning.plan_codec import decode_rank_plan, encode_local_plan, encode_rank_rows
from unickpt.planning.regular import regularize
from unickpt.planning.regular_plan import RegularRankPlans, chunk_rule, plan_regular
from unickpt.planning.save_plan import GlobalSavePlan, LocalSavePlan, _plan_records, plan_save, rank_plan_rows
from unickpt.planning.shard_table import ShardTable
from unickpt.planning.specs import BlobSpec, ShardSpec

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None)
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
@SETTINGS
def test_regular_jobs_are_planned_as_by_the_record_planner(job):
    plans, files = job
    want = _reference(plans, files)
    got = plan_regular([encode_local_plan(p) for p in plans], SAVE_ID, files)
    if got is None:  # only where regularize itself keeps no layout or its fallback applies
        assert plan_save(plans, SAVE_ID, files).rank_plans == want.rank_plans
        return
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
    renamed = got.rank_plans.renamed("20250101T000000-feedfacecafe")
    assert [rp.entries[0].file if rp.entries else "" for rp in renamed] == [
        rp.entries[0].file.replace(SAVE_ID, "20250101T000000-feedfacecafe") if rp.entries else ""
        for rp in want.rank_plans
    ]


def _outside_layouts(g: GlobalSavePlan, rank: int, item: int, plans: list[LocalSavePlan]) -> bool:
    split = {fqn for _files, entries in g.layouts for fqn, _ in entries}
    return plans[rank].shards[item].fqn not in split


@given(regular_jobs(partial=True))
@SETTINGS
def test_every_job_gets_the_record_planners_plan(job):
    """Jobs with tensors split over part of the job fall through; plan_save's plan is the
    reference's in every case."""
    plans, files = job
    _same(plan_save(plans, SAVE_ID, files), _reference(plans, files))
    _same(plan_save([encode_local_plan(p) for p in plans], SAVE_ID, files), _reference(plans, files))


@given(
    extent=st.integers(0, 40),
    world=st.integers(2, 50),
    other=st.integers(0, 4),
    d=st.integers(0, 1),
)
@settings(max_examples=300, deadline=None)
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


def test_a_fsdp_like_job_of_many_ranks_is_one_template():
    """1,000 ranks, each chunk r of 50 tensors plus 50 replicated steps: one template, every
    rank's part computed when asked, the steps given by worst-fit as the record planner gives
    them (to the lightest rank: the last, whose chunks are short)."""
    world = 1000
    plans = []
    for r in range(world):
        specs = []
        for i in range(50):
            rows = world * (4 + i) - i % 3  # every rank's chunk has rows, the last a few fewer
            lo, n = _chunk(rows, world, r)
            specs.append(ShardSpec(f"model.w{i}", "bfloat16", (rows, 8), (lo, 0), (n, 8)))
            specs.append(ShardSpec(f"optim.step{i}", "float32", (), (), ()))
        plans.append(LocalSavePlan(r, tuple(specs)))
    g = plan_save([encode_local_plan(p) for p in plans], SAVE_ID, 2)
    assert isinstance(g.rank_plans, RegularRankPlans)
    assert len(set(g.rank_plans.template_of.tolist())) == 1
    assert sorted(w[0] for w in g.writers) == sorted(f"optim.step{i}" for i in range(50))
    assert [w[:4] for w in g.writers] == [w[:4] for w in _reference(plans[:], 2).writers]
