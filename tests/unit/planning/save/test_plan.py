"""The save planner (``planning.save.plan.plan_save``) on worked examples: replica choice
(a named source, a source that holds nothing, groups naming different sources), refusals
(disagreeing ranks, bad tilings, worded rank by rank on groups), worst-fit order, and the rank
groups (``templates.RegularRankPlans``) of typical jobs: FSDP-like (one template), DDP-like, a
rank left without a layout file, a tensor chunked on some ranks only, a box held twice, a chunk
another rank holds too, many groups, a table naming a tensor no row uses; each against the
reference planner (``tests.support.save_oracle``) where it has one. Pure, no processes. The
properties on random jobs: ``test_plan_properties.py``."""

from __future__ import annotations

import pytest

from tests.support.save_oracle import assert_same_plan, regularize
from tests.support.save_oracle import outcome as _outcome
from tests.support.save_oracle import plan_records as _plan_records
from unickpt.errors import CheckpointError, PlanningError
from unickpt.planning.save import GlobalSavePlan, LocalSavePlan, plan_save
from unickpt.planning.save.table import ShardTable
from unickpt.planning.save.templates import RegularRankPlans
from unickpt.planning.save.wire import LocalPlans, decode_local_table, encode_local_plan
from unickpt.planning.specs import BlobSpec, ShardSpec

SAVE_ID = "20250101T000000-0123456789ab"


def _writer(plan, fqn: str) -> int:
    return next(rank for f, _o, _l, rank, _i in plan.writers if f == fqn)


def test_replica_source_honoured_and_others_balanced() -> None:
    """A buffer replicated on 4 ranks whose spec names rank 0 as its source is written by rank 0
    even when worst-fit would pick another; parameters without a source are balanced."""
    plans = []
    for r in range(4):
        shards = (
            ShardSpec("model.w", "float32", (64,), (0,), (64,)),  # replicated parameter
            ShardSpec("model.bn.running_mean", "float32", (8,), (0,), (8,), replica_source=0),
            ShardSpec("model.bn.running_var", "float32", (8,), (0,), (8,), replica_source=0),
        )
        plans.append(LocalSavePlan(r, shards))
    plan = plan_save(plans, "s")
    assert _writer(plan, "model.bn.running_mean") == 0 and _writer(plan, "model.bn.running_var") == 0
    assert _writer(plan, "model.w") != 0  # rank 0 already holds the buffers: the big one goes elsewhere


def test_replica_source_not_a_holder_falls_back_to_balancing() -> None:
    plans = [LocalSavePlan(r, (ShardSpec("model.b", "float32", (4,), (0,), (4,), replica_source=3),)) for r in range(2)]
    assert _writer(plan_save(plans, "s"), "model.b") in (0, 1)


def test_replica_groups_naming_different_sources_take_the_lowest() -> None:
    plans = [
        LocalSavePlan(r, (ShardSpec("model.b", "float32", (4,), (0,), (4,), replica_source=2 * (r // 2)),))
        for r in range(4)
    ]
    assert _writer(plan_save(plans, "s"), "model.b") == 0


def test_issue11_plan_save_refuses_disagreeing_metadata_and_bad_tilings():
    w = ShardSpec("model.w", "float32", (4, 2), (0, 0), (2, 2))
    rest = ShardSpec("model.w", "float32", (4, 2), (2, 0), (2, 2))
    with pytest.raises(PlanningError, match=r"model\.w: rank 1 has dtype bfloat16 shape \(4, 2\)"):
        plan_save(
            [LocalSavePlan(0, (w,)), LocalSavePlan(1, (ShardSpec("model.w", "bfloat16", (4, 2), (2, 0), (2, 2)),))], "s"
        )
    with pytest.raises(PlanningError, match=r"model\.w: rank 1 has dtype float32 shape \(5, 2\)"):
        plan_save(
            [LocalSavePlan(0, (w,)), LocalSavePlan(1, (ShardSpec("model.w", "float32", (5, 2), (2, 0), (2, 2)),))], "s"
        )
    with pytest.raises(PlanningError, match="do not tile"):  # rows 2-3 saved by nobody
        plan_save([LocalSavePlan(0, (w,)), LocalSavePlan(1, ())], "s")
    with pytest.raises(PlanningError, match="do not tile"):  # overlapping, different boxes
        overlap = ShardSpec("model.w", "float32", (4, 2), (1, 0), (3, 2))
        plan_save([LocalSavePlan(0, (w,)), LocalSavePlan(1, (overlap,))], "s")
    with pytest.raises(PlanningError, match="files_per_rank"):
        plan_save([LocalSavePlan(0, (w, rest))], "s", 0)
    with pytest.raises(PlanningError, match="in order"):
        plan_save([LocalSavePlan(1, (w,)), LocalSavePlan(0, (rest,))], "s")


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


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    c = -(-n // parts)
    lo = min(n, i * c)
    return lo, min(n, lo + c) - lo


def _reference(plans: list[LocalSavePlan], files: int) -> GlobalSavePlan:
    return regularize(_plan_records(plans, SAVE_ID, files), files)


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
        assert_same_plan(g, _reference(plans, files))


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
    assert_same_plan(g, want)


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
        assert_same_plan(g, want)


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
        assert_same_plan(g, _reference(plans, files))


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
        assert_same_plan(g, want)


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
        assert_same_plan(g, _reference(plans, files))


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
    assert_same_plan(plan_save(real, SAVE_ID, 2), want)
    ghosts = [ShardTable(r, ("ghost",), ("float32",), none, none, none, none, flat, flat, flat) for r in range(2)]
    assert_same_plan(plan_save(ghosts, SAVE_ID, 2), _reference([t.to_plan() for t in ghosts], 2))


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
